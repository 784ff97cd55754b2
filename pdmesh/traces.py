"""`pdmesh traces`: recent requests from the embedded trace store, and one request's tree."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sqlite3
import sys
import time
from pathlib import Path

DEFAULT_DB = "pdmesh-traces.sqlite"
STATUS_ERROR = 2


class TraceStoreError(Exception):
    """The store cannot be read: missing, not SQLite, or not a pdmesh trace store."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", nargs="?", help="a trace id or request id (or a prefix): "
                        "print that request's span tree")
    parser.add_argument("--db", default=DEFAULT_DB,
                        help=f"the trace store `pdmesh up --trace-store` writes ({DEFAULT_DB})")
    parser.add_argument("--aborted", action="store_true", help="only aborted requests")
    parser.add_argument("--reason", help="only aborts with this pdmesh.abort.reason")
    parser.add_argument("--since", help="only requests started this long ago or less "
                        "(e.g. 30s, 10m, 2h)")
    parser.add_argument("--slowest", type=int, metavar="N",
                        help="the N slowest requests instead of the most recent")
    parser.add_argument("--limit", type=int, default=20, help="requests listed (20)")
    parser.add_argument("--json", action="store_true", help="JSON instead of text")


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not match:
        raise ValueError(f"bad duration {text!r}: use e.g. 30s, 10m, 2h")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def open_store(path: str | Path) -> sqlite3.Connection:
    path = Path(path)
    if not path.exists():
        raise TraceStoreError(f"no trace store at {path} (start the mesh with "
                              f"`pdmesh up --trace-store {path}`)")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        db.execute("SELECT trace_id FROM spans LIMIT 1").fetchall()
    except sqlite3.DatabaseError as e:
        raise TraceStoreError(f"{path} is not a readable pdmesh trace store: {e}") from None
    return db


LOW_DISK_BYTES = 1 << 20


def store_warnings(db: sqlite3.Connection, path: str | Path) -> list[str]:
    """What an operator should know before trusting the list: the store's disk filled up
    (the oldest spans were dropped to make room, or new ones are being refused)."""
    warnings = []
    try:
        noted = dict(db.execute("SELECT key, value FROM store_info").fetchall())
    except sqlite3.OperationalError:  # a store from before store_info
        noted = {}
    if noted.get("dropped_disk_full"):
        warnings.append(f"the disk holding {path} filled up: the {noted['dropped_disk_full']} "
                        f"oldest spans were dropped to make room")
    free = shutil.disk_usage(Path(path).resolve().parent).free
    if free < LOW_DISK_BYTES:
        warnings.append(f"the disk holding {path} is full ({free} bytes free): new spans "
                        f"push out old ones or are refused, so recent requests may be missing")
    return warnings


def _span(row) -> dict:
    (trace_id, span_id, parent_id, service, name, start, end, status, message,
     attributes, events) = row
    return {"trace_id": trace_id, "span_id": span_id, "parent_id": parent_id,
            "service": service, "name": name, "start_ns": start, "end_ns": end,
            "duration_ms": round((end - start) / 1e6, 3), "status": status,
            "error": status == STATUS_ERROR, "message": message,
            "attributes": json.loads(attributes), "events": json.loads(events)}


def requests(db: sqlite3.Connection, aborted: bool = False, reason: str | None = None,
             since: float | None = None, slowest: int | None = None,
             limit: int = 20) -> list[dict]:
    """Root spans of requests (the router's), newest first or slowest first."""
    where, args = ["parent_id = ''", "service LIKE '%router%'"], []
    if since is not None:
        where.append("start_ns >= ?")
        args.append(int((time.time() - since) * 1e9))
    if aborted or reason:
        where.append("status = ?")
        args.append(STATUS_ERROR)
    if reason:
        where.append("json_extract(attributes, '$.\"pdmesh.abort.reason\"') = ?")
        args.append(reason)
    order = "end_ns - start_ns DESC" if slowest else "start_ns DESC"
    rows = db.execute(f"SELECT * FROM spans WHERE {' AND '.join(where)} ORDER BY {order} "
                      "LIMIT ?", (*args, slowest or limit)).fetchall()
    return [_span(row) for row in rows]


def trace(db: sqlite3.Connection, ident: str) -> list[dict]:
    """Every span of the trace named by a trace id or a request id (or a prefix of one)."""
    found = db.execute(
        "SELECT trace_id FROM spans WHERE trace_id LIKE ? OR "
        "json_extract(attributes, '$.\"pdmesh.request.id\"') LIKE ? LIMIT 1",
        (f"{ident}%", f"{ident}%"),
    ).fetchone()
    if found is None:
        return []
    rows = db.execute("SELECT * FROM spans WHERE trace_id = ? ORDER BY start_ns",
                      (found[0],)).fetchall()
    return [_span(row) for row in rows]


def _summary(root: dict) -> str:
    a = root["attributes"]
    state = (f"ABORTED {a.get('pdmesh.abort.reason', '?')} in {a.get('pdmesh.abort.stage', '?')}"
             if root["error"] else "ok")
    when = time.strftime("%H:%M:%S", time.localtime(root["start_ns"] / 1e9))
    request_id = a.get("pdmesh.request.id", "")[:12] or root["trace_id"][:12]
    return f"{when}  {root['duration_ms']:9.1f} ms  {request_id:12}  {root['name']:28} {state}"


def _label(span: dict) -> str:
    a = {k: v for k, v in span["attributes"].items() if k.startswith(("pdmesh.", "gen_ai."))}
    status = " ERROR" if span["error"] else ""
    extras = " ".join(f"{k}={v}" for k, v in a.items())
    events = ",".join(e["name"] for e in span["events"])
    return (f"{span['service']}: {span['name']} {span['duration_ms']:.1f} ms{status}"
            + (f"  [{extras}]" if extras else "") + (f"  events: {events}" if events else ""))


def render_tree(spans: list[dict], rich: bool) -> str:
    children: dict[str, list[dict]] = {}
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] not in ids]
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    if rich:
        from rich.console import Console
        from rich.tree import Tree

        def grow(node, span):
            for child in children.get(span["span_id"], []):
                grow(node.add(_label(child), style="red" if child["error"] else None), child)

        console = Console(record=True, width=160)
        for root in roots:
            tree = Tree(_label(root), style="red" if root["error"] else None)
            grow(tree, root)
            console.print(tree)
        return ""
    lines: list[str] = []

    def walk(span, depth):
        lines.append("  " * depth + _label(span))
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        db = open_store(args.db)
        since = parse_duration(args.since) if args.since else None
    except (TraceStoreError, ValueError) as e:
        print(f"pdmesh traces: {e}", file=sys.stderr)
        return 1
    try:
        return _answer(db, args, since)
    except sqlite3.DatabaseError as e:  # a file damaged past its first page
        print(f"pdmesh traces: {args.db} is damaged: {e}", file=sys.stderr)
        return 1
    finally:
        db.close()


def _answer(db: sqlite3.Connection, args: argparse.Namespace, since: float | None) -> int:
    for warning in store_warnings(db, args.db):
        print(f"pdmesh traces: warning: {warning}", file=sys.stderr)
    with db:
        if args.id:
            spans = trace(db, args.id)
            if not spans:
                print(f"pdmesh traces: no trace or request {args.id!r} in {args.db}",
                      file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(spans, indent=1))
            else:
                text = render_tree(spans, rich=sys.stdout.isatty())
                if text:
                    print(text)
            return 0
        found = requests(db, args.aborted, args.reason, since, args.slowest, args.limit)
    if args.json:
        print(json.dumps(found, indent=1))
    elif not found:
        print("no requests match")
    else:
        for root in found:
            print(_summary(root))
    return 0
