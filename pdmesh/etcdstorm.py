"""The abort storm against a mesh over etcd with two bootstrap replicas and two routers,
one replica and one router SIGKILLed mid-storm.

    python -m pdmesh.etcdstorm [--waves 6] [--concurrency 12] [--kill-wave 2]

Each wave sends --concurrency long requests, spread over the routers still alive, each
cancelled by its client at a random time (as `pdmesh storm --mode abort`). During
--kill-wave, bootstrap-0 and router-0 are SIGKILLed. Checks: every wave quiescent
(inflight 0, 0 KV pages) within 1 s of its last cancel, 0 pinned rooms at the end, and no
request failed except those in flight on the killed router (counted apart).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import anyio

from pdmesh.client import GenerateClient
from pdmesh.etcdmesh import EtcdMesh
from pdmesh.status import collect
from pdmesh.storm.common import cancel_after, kv_members, wait_quiet, words

QUIET_BUDGET = 1.0


async def storm(mesh: EtcdMesh, waves: int, concurrency: int, kill_wave: int,
                prompt_words: int = 200, max_tokens: int = 64, seed: int = 0) -> dict:
    rng = random.Random(seed)
    survivor = f"127.0.0.1:{mesh.bootstrap_ports[-1]}"
    outcomes: dict[str, dict[str, int]] = {}  # "router-i" or "router-0@kill" -> outcome
    quiesce: list[float | None] = []
    killed_at: float | None = None

    async def one(router: str, label: str, delay: float, prompt: str) -> None:
        grpc_port = mesh.router_ports[router][1]
        async with GenerateClient(f"127.0.0.1:{grpc_port}", timeout=30) as client:
            outcome = await cancel_after(client, delay, prompt=prompt, max_tokens=max_tokens)
        counts = outcomes.setdefault(label, {})
        counts[outcome] = counts.get(outcome, 0) + 1

    async def kill() -> None:
        nonlocal killed_at
        await anyio.sleep(0.3)  # mid-wave: requests are in prefill, transfer and decode
        killed_at = time.monotonic()
        mesh.kill("bootstrap-0")
        mesh.kill("router-0")

    for wave in range(waves):
        alive = [r for r in mesh.router_ports if mesh.processes[r].poll() is None]
        async with anyio.create_task_group() as tg:
            if wave == kill_wave:
                tg.start_soon(kill)
            for i in range(concurrency):
                router = alive[i % len(alive)]
                label = f"{router}@kill" if wave == kill_wave and router == "router-0" else router
                tg.start_soon(one, router, label, rng.uniform(0.02, 1.0),
                              f"{wave}-{i} {words(rng, prompt_words)}")
        quiesce.append(await wait_quiet(survivor, time.monotonic(), limit=30.0))
        print(f"wave {wave + 1}/{waves}: quiescent in {quiesce[-1]}", flush=True)
    status = await collect(survivor)
    pinned = sum(len(m["pinned"]) for m in kv_members(status))
    in_flight_on_killed = sum(v for k, v in outcomes.get("router-0@kill", {}).items()
                              if k.startswith("error:"))
    lost = sum(v for label, counts in outcomes.items() if label != "router-0@kill"
               for k, v in counts.items() if k.startswith("error:"))
    q = [30.0 if s is None else s for s in quiesce]
    checks = {
        f"every wave quiescent within {QUIET_BUDGET} s": max(q) <= QUIET_BUDGET,
        "0 pinned rooms": pinned == 0,
        "no request lost beyond those in flight on the killed router": lost == 0,
    }
    if 0 <= kill_wave < waves:
        checks["the replica and the router really died"] = (
            killed_at is not None and mesh.processes["bootstrap-0"].poll() is not None
            and mesh.processes["router-0"].poll() is not None)
    return {"ok": all(checks.values()), "checks": checks, "quiesce_s": quiesce,
            "max_quiesce_s": max(q), "pinned": pinned, "lost": lost,
            "in_flight_on_killed_router": in_flight_on_killed, "outcomes": outcomes,
            "requests": waves * concurrency}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.etcdstorm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waves", type=int, default=6, help="waves (6)")
    parser.add_argument("--concurrency", type=int, default=12, help="requests per wave (12)")
    parser.add_argument("--kill-wave", type=int, default=2,
                        help="the wave during which bootstrap-0 and router-0 die (2; -1: none, "
                        "the baseline)")
    parser.add_argument("--model", default="tiny", help="model of the mesh (tiny)")
    parser.add_argument("--out", default=None, help="JSON output path (default: stdout only)")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="pdmesh-etcdstorm-"))
    mesh = EtcdMesh(directory, model=args.model, lease=3.0)
    try:
        mesh.start()
        result = anyio.run(storm, mesh, args.waves, args.concurrency, args.kill_wave)
    finally:
        mesh.stop()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    print(f"verdict: {'PASS' if result['ok'] else 'FAIL'} (logs in {directory})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
