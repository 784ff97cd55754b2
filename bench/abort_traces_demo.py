"""Seven requests, six of them aborted in every way the contract names, on a tiny mesh
with the embedded trace store; then what `pdmesh traces --aborted` shows of them.

The prefill's compute thread sleeps before each forward pass and its final write waits,
so each stage lasts long enough to leave in: a client gone while its request is queued
behind another, during the prefill, during the KV transfer and during the decode; a
gRPC deadline shorter than the prefill; and the prefill killed mid-request.

    python -m bench.abort_traces_demo [--db /tmp/pdmesh-demo/traces.sqlite]
    pdmesh traces --db /tmp/pdmesh-demo/traces.sqlite ID     # one request's tree
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import grpc

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import start_mesh

FAULTS = "stall_forward=0.6,delay_kv_ready=1.0"
PROMPT = "river engine " * 10


async def request(router: str, prompt: str = PROMPT, max_tokens: int = 4,
                  leave_after: float | None = None, leave_after_tokens: int | None = None,
                  timeout: float = 60.0) -> str:
    """One request; returns how it ended, as the client saw it."""
    tokens = 0
    try:
        async with GenerateClient(router, timeout=timeout) as client:
            with anyio.move_on_after(leave_after if leave_after is not None else 120):
                async for item in client.generate(prompt=prompt, max_tokens=max_tokens,
                                                  ignore_eos=True):
                    if isinstance(item, Piece):
                        tokens += len(item.token_ids)
                        if leave_after_tokens is not None and tokens >= leave_after_tokens:
                            return f"left after {tokens} tokens"
                return f"{tokens} tokens"
        return f"left after {leave_after} s"
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"


async def demo(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    db.unlink(missing_ok=True)
    mesh = await anyio.to_thread.run_sync(lambda: start_mesh(
        db.parent, model="tiny", extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        up_args=["--trace-store", str(db), "--faults", FAULTS, "--router-args", "--retries 0"]))
    router = mesh.router
    try:
        print("normal:      ", await request(router))
        async with anyio.create_task_group() as tg:
            tg.start_soon(request, router)  # holds the compute thread
            await anyio.sleep(0.2)
            print("queued:      ", await request(router, "queued " * 20, leave_after=0.2))
        print("prefill:     ", await request(router, leave_after=0.3))
        print("transfer:    ", await request(router, leave_after=1.1))
        print("decode:      ", await request(router, max_tokens=400, leave_after_tokens=2))
        print("deadline:    ", await request(router, timeout=0.5))
        pid = mesh.pid_of("prefill")
        async with anyio.create_task_group() as tg:
            async def kill() -> None:
                await anyio.sleep(0.3)
                os.kill(pid, signal.SIGKILL)

            tg.start_soon(kill)
            print("prefill dies:", await request(router))
        await anyio.sleep(2)  # the last spans reach the store
    finally:  # stop the mesh even when the demo is cancelled (Ctrl-C); mesh.stop waits 30 s
        with anyio.move_on_after(35, shield=True):
            await anyio.to_thread.run_sync(mesh.stop)
    print(f"\n$ pdmesh traces --db {db} --aborted")
    subprocess.run([sys.executable, "-m", "pdmesh.cli", "traces", "--db", str(db), "--aborted"],
                   check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=Path("/tmp/pdmesh-demo/traces.sqlite"))
    anyio.run(demo, parser.parse_args().db)


if __name__ == "__main__":
    main()
