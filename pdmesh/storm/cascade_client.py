"""The agent that `pdmesh storm --mode cascade` kills: C sessions streaming requests back
to back until SIGKILL, with no goodbye (the field report's incident 1 client).

    python -m pdmesh.storm.cascade_client --router HOST:PORT --sessions 60 ...

It is its own process so that its death is real: the kernel closes its sockets and the
router learns of 60 disconnects at once, as in production. Once a second it prints a
JSON line with its counters (started, completed, in flight, tokens, errors) so the storm
knows the load was really on when it pulled the trigger.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import anyio  # noqa: E402
import grpc  # noqa: E402

from pdmesh.client import GenerateClient  # noqa: E402
from pdmesh.storm.common import error_kind, words  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdmesh.storm.cascade_client")
    p.add_argument("--router", required=True)
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parent", type=int, default=0, help="die with this pid (the storm)")
    return p.parse_args(argv)


def die_with_parent(parent: int) -> None:
    """A storm that crashes must not leave a client loading the mesh forever (Linux)."""
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


async def session(client: GenerateClient, args, index: int, counters: dict) -> None:
    """Requests back to back, forever: the parent's SIGKILL is the only way out."""
    rng = random.Random(args.seed * 1_000_003 + index)
    while True:
        counters["started"] += 1
        counters["inflight"] += 1
        try:
            messages = [{"role": "user", "content": f"{index} {words(rng, args.prompt_words)}"}]
            async for item in client.generate(messages=messages, max_tokens=args.max_tokens,
                                              temperature=0, ignore_eos=True):
                counters["tokens"] += len(getattr(item, "token_ids", []))
            counters["completed"] += 1
        except grpc.aio.AioRpcError as e:
            errors = counters["errors"]
            errors[error_kind(e)] = errors.get(error_kind(e), 0) + 1
            await anyio.sleep(0.1)
        finally:
            counters["inflight"] -= 1


async def report(counters: dict) -> None:
    while True:
        await anyio.sleep(1.0)
        print(json.dumps(counters), flush=True)


async def main(args) -> None:
    counters = {"started": 0, "completed": 0, "inflight": 0, "tokens": 0, "errors": {}}
    async with GenerateClient(args.router) as client, anyio.create_task_group() as tg:
        tg.start_soon(report, counters)
        for i in range(args.sessions):
            tg.start_soon(session, client, args, i, counters)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    die_with_parent(arguments.parent)
    anyio.run(main, arguments)
