"""Mode `abort` (the field report's abort cascade, aimed at W1-W4).

Waves of C concurrent requests with long prompts, each cancelled by its client at a
random time in [--abort-min, --abort-max]. After each wave's last cancel the storm
times how long until every member reports inflight 0 and 0 KV pages used
(abort-to-quiescence, per wave). Checks: every wave quiescent within --quiet-budget and
no request failing with anything but its own cancellation (a full mesh refusing with
RESOURCE_EXHAUSTED is the bounds working, not a failure).
"""

from __future__ import annotations

import random
import statistics
import time

import anyio

from pdmesh.client import GenerateClient
from pdmesh.storm.common import Timeline, cancel_after, count, ms, pct, wait_quiet, words


async def _one(client: GenerateClient, prompt: str, delay: float, args,
               outcomes: dict) -> None:
    count(outcomes, await cancel_after(client, delay, prompt=prompt,
                                       max_tokens=args.max_tokens))


async def _wave(client: GenerateClient, args, rng: random.Random, wave: int,
                outcomes: dict) -> float | None:
    """One wave; returns its abort-to-quiescence in seconds (None: not within 30 s)."""
    delays = [rng.uniform(args.abort_min, args.abort_max) for _ in range(args.concurrency)]
    async with anyio.create_task_group() as tg:
        for i, delay in enumerate(delays):
            prompt = f"{wave}-{i} {words(rng, args.prompt_words)}"
            tg.start_soon(_one, client, prompt, delay, args, outcomes)
    return await wait_quiet(args.bootstrap, time.monotonic(), limit=30.0)


async def run(args, timeline: Timeline) -> dict:
    rng = random.Random(args.seed)
    quiesce: list[float | None] = []
    outcomes: dict[str, int] = {}
    async with GenerateClient(args.router) as client:
        for wave in range(args.waves):
            quiesce.append(await _wave(client, args, rng, wave, outcomes))
            print(f"wave {wave + 1}/{args.waves}: quiescent {ms(quiesce[-1])} after its "
                  "last cancel", flush=True)
    q = [30.0 if s is None else s for s in quiesce]
    errors = {k: v for k, v in outcomes.items() if k.startswith("error:")}
    print(f"requests: {outcomes}")
    print(f"abort-to-quiescence per wave of {args.concurrency}: p50 "
          f"{ms(statistics.median(q))}, p99 {ms(pct(q, 0.99))}, max {ms(max(q))} "
          f"over {len(q)} waves")
    return {
        "figures": {"quiesce_s": quiesce},
        "outcomes": outcomes,
        "checks": [
            (f"every wave quiescent within {args.quiet_budget} s of its last cancel",
             max(q) <= args.quiet_budget),
            (f"no request failed but by its own cancel (errors: {errors or 'none'})",
             not errors),
        ],
    }
