"""`pdmesh storm`: load and faults against a running mesh, with a timeline and a verdict.

Mode `abort` (the field report's abort cascade, aimed at W1-W4): waves of C
concurrent requests with long prompts, each cancelled by its client at a random
time in [--abort-min, --abort-max]. After each wave's last cancel, the storm
times how long until every member reports inflight 0 and 0 KV pages used
(abort-to-quiescence, per wave). A sampler records the mesh's counters every
100 ms for the timeline. Verdict: every wave quiescent within --quiet-budget,
no pinned room, and no request failing with anything but its own cancellation.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import anyio
import grpc

from pdmesh.client import GenerateClient
from pdmesh.status import collect

WORDS = "river engine harbour lantern meadow copper signal orchard thunder violet".split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["abort"], default="abort",
                        help="abort: waves of requests each cancelled at a random time")
    parser.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    parser.add_argument("--bootstrap", default="127.0.0.1:50050", help="bootstrap address")
    parser.add_argument("--concurrency", type=int, default=64, help="requests per wave (64)")
    parser.add_argument("--waves", type=int, default=32, help="waves (32: 2,048 aborts)")
    parser.add_argument("--prompt-words", type=int, default=400, help="words per prompt (400)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens asked per request")
    parser.add_argument("--abort-min", type=float, default=0.02, help="earliest cancel (s)")
    parser.add_argument("--abort-max", type=float, default=1.0, help="latest cancel (s)")
    parser.add_argument("--quiet-budget", type=float, default=1.0,
                        help="seconds a wave may take to quiesce after its last cancel (1.0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the schedule")
    parser.add_argument("--out", default="bench-results/storm.json", help="JSON output path")


def _quiet(status: dict) -> bool:
    return all(
        not m["inflight"] and not m["kv_pages_used"]
        for m in status["members"] if m["role"] in ("prefill", "decode")
    )


def _row(status: dict, t: float) -> dict:
    kv = [m for m in status["members"] if m["role"] in ("prefill", "decode")]
    return {
        "t": round(t, 3),
        "inflight": sum(m["inflight"] or 0 for m in kv),
        "kv_pages_used": sum(m["kv_pages_used"] or 0 for m in kv),
        "transfer_failed": sum(m["transfer_failed_total"] or 0 for m in kv),
        "aborts": sum(m["aborts_total"] or 0 for m in kv),
        "pinned": sum(len(m["pinned"]) for m in kv),
    }


async def _one(client: GenerateClient, prompt: str, cancel_after: float, args,
               outcomes: dict) -> None:
    tokens = 0
    with anyio.move_on_after(cancel_after) as scope:
        try:
            async for item in client.generate(prompt=prompt, max_tokens=args.max_tokens,
                                              temperature=0, ignore_eos=True):
                tokens += len(getattr(item, "token_ids", []))
        except grpc.aio.AioRpcError as e:
            # a full mesh refusing cleanly is the bounds working, not a failure
            kind = "refused" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
            outcomes[f"{kind}:{e.code().name}"] = outcomes.get(f"{kind}:{e.code().name}", 0) + 1
            return
    key = ("cancelled_streaming" if tokens else "cancelled_before_first_token") \
        if scope.cancelled_caught else "completed"
    outcomes[key] = outcomes.get(key, 0) + 1


async def run_abort(args) -> dict:
    rng = random.Random(args.seed)
    timeline: list[dict] = []
    quiesce: list[float] = []
    outcomes: dict[str, int] = {}
    started = time.monotonic()
    stop_sampling = anyio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            timeline.append(_row(await collect(args.bootstrap), time.monotonic() - started))
            await anyio.sleep(0.1)

    async with anyio.create_task_group() as outer, GenerateClient(args.router) as client:
        outer.start_soon(sample)
        for wave in range(args.waves):
            delays = [rng.uniform(args.abort_min, args.abort_max)
                      for _ in range(args.concurrency)]
            async with anyio.create_task_group() as tg:
                for i, delay in enumerate(delays):
                    words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                    tg.start_soon(_one, client, f"{wave}-{i} {words}", delay, args, outcomes)
            last_cancel = time.monotonic()
            while not _quiet(await collect(args.bootstrap)):
                if time.monotonic() - last_cancel > 30:
                    break
                await anyio.sleep(0.005)
            quiesce.append(time.monotonic() - last_cancel)
            print(f"wave {wave + 1}/{args.waves}: quiescent {quiesce[-1] * 1000:.0f} ms after "
                  f"its last cancel", flush=True)
        stop_sampling.set()
    final = await collect(args.bootstrap)
    return {"timeline": timeline, "quiesce_s": quiesce, "outcomes": outcomes, "final": final}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def report(args, result: dict) -> bool:
    q = result["quiesce_s"]
    final_rows = _row(result["final"], 0)
    errors = {k: v for k, v in result["outcomes"].items() if k.startswith("error:")}
    pinned_ever = max((r["pinned"] for r in result["timeline"]), default=0)
    print("\ntimeline (every ~1 s): t inflight kv_pages transfer_failed aborts pinned")
    for row in result["timeline"][::10]:
        print(f"  {row['t']:7.1f} {row['inflight']:8} {row['kv_pages_used']:8} "
              f"{row['transfer_failed']:15} {row['aborts']:6} {row['pinned']:6}")
    print(f"\nrequests: {result['outcomes']}")
    print(f"abort-to-quiescence per wave of {args.concurrency}: p50 "
          f"{statistics.median(q) * 1000:.0f} ms, p99 {_pct(q, 0.99) * 1000:.0f} ms, "
          f"max {max(q) * 1000:.0f} ms over {len(q)} waves")
    ok = (
        max(q) <= args.quiet_budget and not errors and pinned_ever == 0
        and final_rows["inflight"] == 0 and final_rows["kv_pages_used"] == 0
    )
    print(f"after the load: inflight {final_rows['inflight']}, kv pages "
          f"{final_rows['kv_pages_used']}, pinned ever {pinned_ever}, errors {errors or 'none'}")
    print(f"verdict: {'PASS' if ok else 'FAIL'}")
    return ok


def main(args: argparse.Namespace) -> int:
    result = anyio.run(run_abort, args)
    ok = report(args, result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ok": ok, **result}, indent=1, default=str))
    print(f"wrote {out}")
    return 0 if ok else 1
