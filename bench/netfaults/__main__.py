"""`python -m bench.netfaults`: the fault table (docs/faults.md) from real processes.

Run as root for network namespaces; elsewhere (or with --mode proxy) the loopback fault
proxy stands in. Writes the JSON to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bench.netfaults import namespaces
from bench.netfaults.scenario import FAULTS, answers, run, wait_ready
from bench.netfaults.world import NetnsWorld, ProxyWorld, World
from libs.rpc import tls
from pdmesh.certs import role_env
from pdmesh.client import GenerateClient

LEASE = 2.0
REQUEST_TIMEOUT = 6.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.netfaults", description=__doc__)
    p.add_argument("--mode", choices=["auto", "netns", "proxy"], default="auto",
                   help="auto (default): namespaces where they can be made, else the proxy")
    p.add_argument("--faults", default=",".join(f.kind for f in FAULTS),
                   help="which faults, comma-separated (default all: "
                   f"{','.join(f.kind for f in FAULTS)})")
    p.add_argument("--out", default="bench-results/netfaults.json", help="the JSON")
    p.add_argument("--inside", default=None, help=argparse.SUPPRESS)  # tag:subnet
    return p


def table(result: dict) -> str:
    lines = [f"mode: {result['mode']} ({result['link_note']}); lease {LEASE:g} s, request "
             f"deadline {REQUEST_TIMEOUT:g} s", "",
             "| fault | requests | aborted | failed | pinned | corrupt | recovery s | checks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['fault']} | skipped: {r['skipped']} | | | | | | |")
            continue
        rec = "never" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        verdict = "PASS" if r["passed"] else "FAIL: " + "; ".join(
            k for k, ok in r["checks"].items() if not ok)
        lines.append(f"| {r['fault']} | {r['requests']} | {r['aborted']} | {r['failed']} | "
                     f"{r['pinned']} | {r['corrupt'] + r['replay_corrupt']} | {rec} | "
                     f"{verdict} |")
    return "\n".join(lines)


async def scenarios(world: World, kinds: list[str]) -> dict:
    tls.use_for_clients(tls.from_env(role_env(world.certs, "client")))
    started = time.monotonic()
    world.start_all()
    rows = []
    async with GenerateClient(world.router, timeout=REQUEST_TIMEOUT) as client:
        if await wait_ready(client, world, None, 180) is None:
            raise SystemExit(f"bench.netfaults: the mesh did not start in 180 s; logs in "
                             f"{world.workdir}")
        baseline = await answers(client)
        if any(isinstance(b, str) for b in baseline):
            raise SystemExit(f"bench.netfaults: baseline requests failed: {baseline}")
        ready = time.monotonic() - started
        for fault in FAULTS:
            if fault.kind in kinds:
                row = await run(world, client, fault, baseline)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"mode": world.kind, "link_note": world.link_note, "start_s": ready, "rows": rows}


def inside(args: argparse.Namespace) -> dict:
    """In the client namespace: run the services in theirs, then the faults."""
    tag, subnet = args.inside.split(":", 1)
    topology = namespaces.Topology(tag, int(subnet))
    workdir = Path(tempfile.mkdtemp(prefix="pdmesh-netfaults-"))
    world = NetnsWorld(topology, workdir, LEASE, REQUEST_TIMEOUT,
                       namespaces.unsupported_faults())
    try:
        return anyio.run(scenarios, world, args.faults.split(","))
    finally:
        world.stop()


def in_namespaces(args: argparse.Namespace) -> dict:
    topology = namespaces.Topology(str(os.getpid() % 100000), 200 + os.getpid() % 50)
    topology.create()
    try:
        out = Path(tempfile.mkdtemp(prefix="pdmesh-netfaults-")) / "inside.json"
        code = subprocess.run(
            [*topology.exec_prefix("client"), sys.executable, "-m", "bench.netfaults",
             "--inside", f"{topology.tag}:{topology.subnet}", "--faults", args.faults,
             "--out", str(out)]).returncode
        if not out.exists():  # the run itself broke (a failed check still writes its rows)
            raise SystemExit(code or 1)
        return json.loads(out.read_text())
    finally:
        topology.destroy()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.inside:
        result = inside(args)
    else:
        why = namespaces.unavailable() if args.mode != "proxy" else "--mode proxy"
        if args.mode == "netns" and why:
            raise SystemExit(f"bench.netfaults: --mode netns: {why}")
        if why is None:
            result = in_namespaces(args)
        else:
            if args.mode == "auto":
                print(f"network namespaces unavailable ({why}): the loopback fault proxy "
                      "stands in", flush=True)
            workdir = Path(tempfile.mkdtemp(prefix="pdmesh-netfaults-"))
            world = ProxyWorld(workdir, LEASE, REQUEST_TIMEOUT)
            try:
                result = anyio.run(scenarios, world, args.faults.split(","))
            finally:
                world.stop()
            if args.mode == "auto":
                result["namespaces_unavailable"] = why
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if not args.inside:
        print(table(result))
    return 0 if all(r.get("passed", True) for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
