"""Mode `agentic` (field report incident 3's verification run: sessions x rounds, client
cancels between rounds, 0 corrupt sessions).

S sessions run concurrently, R rounds each. Before each round's real request a session
sends the same conversation and cancels it at a random time in [--abort-min,
--abort-max] (the agent's cancel between rounds, aimed at pages freed or reused while a
write can still land: W2-W4). The real request is greedy; its reply is appended to the
conversation, then the next user turn. Afterwards every session is replayed alone,
sequentially, without cancels, with the same user turns: greedy decoding makes the
replay the ground truth, so a session whose token ids differ in any round read
someone else's KV (or lost some of its own). Checks: 0 corrupt, 0 failed sessions, and
cancels really happened.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import anyio
import grpc

from pdmesh.client import GenerateClient
from pdmesh.storm.common import Timeline, cancel_after, complete, count, error_kind, words

REFUSED_RETRIES = 50  # a well-behaved agent retries a full mesh's RESOURCE_EXHAUSTED
REFUSED_BACKOFF = 0.2


@dataclass
class Plan:
    """A session's fixed script: user turns and when to cancel before each round."""

    index: int
    turns: list[str]
    cancel_after: list[float]


@dataclass
class Conversation:
    """What one run of a session got: token ids per round, or the error that ended it."""

    rounds: list[list[int]] = field(default_factory=list)
    error: str | None = None


def plans(args) -> list[Plan]:
    rng = random.Random(args.seed)
    return [
        Plan(s, [f"session {s} round {r}: {words(rng, args.prompt_words)}"
                 for r in range(args.rounds)],
             [rng.uniform(args.abort_min, args.abort_max) for _ in range(args.rounds)])
        for s in range(args.sessions)
    ]


async def _cancelled(client: GenerateClient, messages: list[dict], after: float, args,
                     outcomes: dict) -> None:
    """The request the agent gives up on: long enough (ignore_eos) to be mid-flight."""
    outcome = await cancel_after(client, after, messages=messages, max_tokens=args.cancel_tokens)
    if outcome == "completed":
        outcome = "completed_first"
    count(outcomes, outcome if outcome.startswith("cancelled") else f"cancel_request_{outcome}")


async def _reply(client: GenerateClient, messages: list[dict], args,
                 outcomes: dict) -> tuple[list[int], str]:
    for _ in range(REFUSED_RETRIES):
        try:
            ids, text, _ = await complete(client, messages, args.max_tokens)
            count(outcomes, "completed")
            return ids, text
        except grpc.aio.AioRpcError as e:
            count(outcomes, error_kind(e))
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await anyio.sleep(REFUSED_BACKOFF)
    raise RuntimeError("refused on every retry")


async def converse(client: GenerateClient, plan: Plan, args, outcomes: dict,
                   cancels: bool) -> Conversation:
    """Run one session's rounds; with `cancels`, a cancelled request precedes each round."""
    result = Conversation()
    messages: list[dict[str, str]] = []
    try:
        for turn, after in zip(plan.turns, plan.cancel_after, strict=True):
            messages.append({"role": "user", "content": turn})
            if cancels:
                await _cancelled(client, messages, after, args, outcomes)
            ids, text = await _reply(client, messages, args, outcomes)
            result.rounds.append(ids)
            messages.append({"role": "assistant", "content": text})
    except (grpc.aio.AioRpcError, RuntimeError) as e:
        result.error = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
    return result


def compare(plan: Plan, storm: Conversation, replay: Conversation) -> dict:
    """One session's verdict: failed (a run did not finish), corrupt (first differing
    round, with both token lists as evidence) or ok."""
    if storm.error or replay.error:
        return {"session": plan.index, "failed": storm.error or f"replay: {replay.error}"}
    for r, (a, b) in enumerate(zip(storm.rounds, replay.rounds, strict=True)):
        if a != b:
            return {"session": plan.index, "corrupt_round": r, "storm": a, "replay": b}
    return {"session": plan.index, "ok": True}


async def run(args, timeline: Timeline) -> dict:
    scripts = plans(args)
    storm: list[Conversation] = [Conversation() for _ in scripts]
    outcomes: dict[str, int] = {}

    async def session(client: GenerateClient, plan: Plan) -> None:
        storm[plan.index] = await converse(client, plan, args, outcomes, cancels=True)

    async with GenerateClient(args.router, timeout=args.request_timeout) as client:
        async with anyio.create_task_group() as tg:
            for plan in scripts:
                tg.start_soon(session, client, plan)
        print(f"storm done at {timeline.now():.1f}s; replaying {len(scripts)} sessions "
              "one by one without cancels", flush=True)
        replay = [await converse(client, plan, args, {}, cancels=False) for plan in scripts]
    verdicts = [compare(p, s, r) for p, s, r in zip(scripts, storm, replay, strict=True)]
    corrupt = [v for v in verdicts if "corrupt_round" in v]
    failed = [v for v in verdicts if "failed" in v]
    cancels = sum(v for k, v in outcomes.items() if k.startswith("cancelled"))
    compared = sum(len(ids) for c in storm for ids in c.rounds)
    print(f"requests: {outcomes}")
    print(f"sessions {args.sessions} x rounds {args.rounds}: {cancels} cancels done, "
          f"{compared} tokens compared with the replay, corrupt {len(corrupt)} (rounds "
          f"{[v['corrupt_round'] for v in corrupt]}), failed {len(failed)} "
          f"{[v['failed'] for v in failed][:5]}")
    return {
        "figures": {"sessions": args.sessions, "rounds": args.rounds, "cancels": cancels,
                    "tokens_compared": compared, "corrupt": len(corrupt),
                    "failed": len(failed), "verdicts": verdicts},
        "outcomes": outcomes,
        "checks": [
            ("cancels really happened before the rounds", cancels > 0),
            ("0 corrupt sessions (storm tokens == sequential replay, every round)",
             not corrupt),
            ("every session finished every round, in the storm and in the replay", not failed),
        ],
    }
