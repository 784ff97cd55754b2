"""Mode `cascade` (field report incident 1: an agent with 60 sessions killed mid-flight).

Each cycle spawns a client process (pdmesh.storm.cascade_client) running C sessions of
streaming requests back to back, SIGKILLs it after T seconds (no cancel, no goodbye:
its sockets just close) and times how long until every prefill and decode reports
inflight 0 and 0 KV pages (kill-to-quiescence). K cycles, then L liveness requests one
after the other. Checks: the client was mid-flight at every kill, every cycle quiescent
within --quiet-budget, every liveness request completed with tokens within
--liveness-timeout. The incident's wedge (a dead consumer thread, health still green)
shows here as a cycle that never quiesces or a liveness request that hangs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import suppress

import anyio
import grpc
from anyio.abc import ByteReceiveStream
from anyio.streams.text import TextReceiveStream

from pdmesh.client import GenerateClient
from pdmesh.status import collect
from pdmesh.storm.common import (
    Timeline,
    aborts_by_reason,
    complete,
    error_kind,
    ms,
    wait_quiet,
)

LIVENESS_TOKENS = 8


def client_argv(args, cycle: int) -> list[str]:
    return [sys.executable, "-m", "pdmesh.storm.cascade_client", "--router", args.router,
            "--sessions", str(args.sessions), "--prompt-words", str(args.prompt_words),
            "--max-tokens", str(args.max_tokens), "--seed", str(args.seed * 100 + cycle),
            "--parent", str(os.getpid())]


async def _follow(stream: ByteReceiveStream, last: dict) -> None:
    """Keep the client's latest counters line (it prints one a second) until EOF."""
    buffer = ""
    async for chunk in TextReceiveStream(stream):
        buffer += chunk
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.startswith("{"):
                last.update(json.loads(line))


async def cycle(args, timeline: Timeline, k: int) -> dict:
    """One client life: spawn, load for --kill-after s, SIGKILL, time the quiescence."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    before = aborts_by_reason(await collect(args.bootstrap))
    client: dict = {}
    process = await anyio.open_process(client_argv(args, k), stdin=subprocess.DEVNULL,
                                       stderr=None, env=env)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_follow, process.stdout, client)
            await anyio.sleep(args.kill_after)
            at_kill = timeline.last()
            with suppress(ProcessLookupError):  # a client that died early is a FAIL below
                process.kill()  # SIGKILL
            killed = time.monotonic()
            await process.wait()
    finally:
        with suppress(ProcessLookupError):
            process.kill()
        with anyio.move_on_after(5.0, shield=True):
            await process.aclose()
    quiet = await wait_quiet(args.bootstrap, killed)
    after = aborts_by_reason(await collect(args.bootstrap))
    aborts = {r: n - before.get(r, 0) for r, n in after.items() if n - before.get(r, 0)}
    print(f"cycle {k + 1}/{args.cycles}: killed the client ({client.get('inflight', '?')} "
          f"requests in flight, {at_kill['kv_pages_used']} KV pages used); quiescent "
          f"{ms(quiet)} after the kill; aborts {aborts}", flush=True)
    return {"quiet_s": quiet, "client": client, "aborts_by_reason": aborts,
            "mesh_at_kill": {key: at_kill[key] for key in ("inflight", "kv_pages_used")}}


async def liveness(args) -> dict:
    """One short greedy request after the storm; ok only with tokens within the timeout."""
    started = time.monotonic()
    result = {"ok": False, "tokens": 0}
    with anyio.move_on_after(args.liveness_timeout):
        try:
            async with GenerateClient(args.router) as client:
                ids, _, reason = await complete(
                    client, [{"role": "user", "content": "Are you alive?"}], LIVENESS_TOKENS)
            result.update(ok=bool(ids), tokens=len(ids), finish_reason=reason)
        except grpc.aio.AioRpcError as e:
            result["error"] = error_kind(e)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


async def run(args, timeline: Timeline) -> dict:
    cycles = [await cycle(args, timeline, k) for k in range(args.cycles)]
    checks = [await liveness(args) for _ in range(args.liveness)]
    alive = sum(c["ok"] for c in checks)
    print(f"liveness: {alive}/{args.liveness} ok, "
          f"{', '.join(ms(c['seconds']) for c in checks)}", flush=True)
    quiet = [c["quiet_s"] for c in cycles]
    return {
        "figures": {"cycles": cycles, "kill_to_quiet_s": quiet, "liveness": checks},
        "outcomes": {"liveness_ok": alive, "liveness_failed": args.liveness - alive},
        "checks": [
            ("the client was mid-flight at every kill",
             all(c["client"].get("inflight") and c["mesh_at_kill"]["kv_pages_used"]
                 for c in cycles)),
            (f"quiescent within {args.quiet_budget} s after every kill "
             f"({', '.join(ms(q) for q in quiet)})",
             all(q is not None and q <= args.quiet_budget for q in quiet)),
            (f"liveness {alive}/{args.liveness} within {args.liveness_timeout} s",
             alive == args.liveness),
        ],
    }
