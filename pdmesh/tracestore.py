"""The embedded trace store: an OTLP/gRPC receiver writing spans into SQLite.

So traces work with no other software installed: `pdmesh up --trace-store PATH` runs
it as a child process and points every member at it, and `pdmesh traces` reads the file.
The table is bounded: past `max_spans` the oldest spans are dropped.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from libs.rpc.options import SERVER_OPTIONS
from libs.rpc.server import bind

log = logging.getLogger("pdmesh.tracestore")

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_id TEXT NOT NULL,
    service TEXT NOT NULL, name TEXT NOT NULL, start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL, status INTEGER NOT NULL, message TEXT NOT NULL,
    attributes TEXT NOT NULL, events TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS spans_trace ON spans (trace_id);
CREATE INDEX IF NOT EXISTS spans_start ON spans (start_ns);
CREATE TABLE IF NOT EXISTS store_info (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
SQLITE_FULL = 13  # "database or disk is full"
ROOM_FRACTION = 10  # on a full disk, drop this fraction (1/N) of the oldest spans
STATUS_ERROR = 2  # OTLP Status.STATUS_CODE_ERROR


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def rows_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[tuple]:
    rows = []
    for resource_spans in request.resource_spans:
        service = next((_value(a.value) for a in resource_spans.resource.attributes
                        if a.key == "service.name"), "unknown")
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                attributes = {a.key: _value(a.value) for a in s.attributes}
                events = [{"name": e.name, "time_ns": e.time_unix_nano,
                           "attributes": {a.key: _value(a.value) for a in e.attributes}}
                          for e in s.events]
                rows.append((
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), service, s.name,
                    s.start_time_unix_nano, s.end_time_unix_nano, s.status.code,
                    s.status.message, json.dumps(attributes), json.dumps(events),
                ))
    return rows


class TraceStore:
    """Spans in one SQLite file, oldest dropped past `max_spans` or when the disk is full.
    Thread-safe. What was dropped, and why, is kept in `store_info` for `pdmesh traces`.

    A full disk is handled like the bound: the oldest tenth of the spans goes, which frees
    pages inside the file for the new ones (SQLite reuses them without growing the file).
    Only when even that fails is the export refused.
    """

    def __init__(self, path: str | Path, max_spans: int = 200_000):
        self.path = Path(path)
        self.max_spans = max_spans
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.executescript(SCHEMA)
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO store_info VALUES ('max_spans', ?)",
                             (max_spans,))
        noted = dict(self._db.execute("SELECT key, value FROM store_info").fetchall())
        self.dropped = noted.get("dropped_past_bound", 0)
        self.dropped_full = noted.get("dropped_disk_full", 0)

    def add(self, rows: list[tuple]) -> None:
        with self._lock:
            try:
                self._insert(rows)
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorcode", None) != SQLITE_FULL:
                    raise
                freed = self._make_room(len(rows))
                log.warning("trace store: the disk is full; dropped the %d oldest spans",
                            freed)
                self._insert(rows)  # still full: the caller refuses the export

    def _insert(self, rows: list[tuple]) -> None:
        with self._db:
            self._db.executemany(
                "INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )
            (count,) = self._db.execute("SELECT COUNT(*) FROM spans").fetchone()
            excess = count - self.max_spans
            if excess > 0:
                self._drop_oldest(excess)
                self.dropped += excess
                self._note("dropped_past_bound", self.dropped)

    def _make_room(self, wanted: int) -> int:
        with self._db:
            (count,) = self._db.execute("SELECT COUNT(*) FROM spans").fetchone()
            freed = min(count, max(wanted, count // ROOM_FRACTION))
            self._drop_oldest(freed)
            self.dropped_full += freed
            self._note("dropped_disk_full", self.dropped_full)
        return freed

    def _drop_oldest(self, n: int) -> None:
        self._db.execute(
            "DELETE FROM spans WHERE rowid IN (SELECT rowid FROM spans ORDER BY rowid LIMIT ?)",
            (n,),
        )

    def _note(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO store_info VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: TraceStore):
        self.store = store

    def Export(self, request, context):
        try:
            self.store.add(rows_of(request))
        except sqlite3.Error as e:  # a full disk or a broken file: refuse, stay up
            log.error("trace store: %s", e)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"trace store: {e}")
        return trace_service_pb2.ExportTraceServiceResponse()


def serve(path: str | Path, host: str, port: int, max_spans: int) -> tuple[grpc.Server, int]:
    """Start the receiver (its own thread pool); returns the server and its port."""
    store = TraceStore(path, max_spans)
    # The options every pdmesh server uses; among them no SO_REUSEPORT (gRPC's default is
    # on), so a port another process holds fails to bind here instead of being shared.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Receiver(store), server)
    bound = bind(server, host, port)
    server.start()
    return server, bound
