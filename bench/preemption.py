"""KV reserved as it is used, against up-front reservation, and a forced preemption storm.

capacity: 40 concurrent requests of max_tokens 1024 that stop after about 40 tokens,
against a decode pool that holds 8 requests' prompt + max_tokens, on two meshes side by
side: `--kv-reserve grow` (the default) and `--kv-reserve upfront`. Each request's stop
string is the text of its own first 40 greedy tokens (measured alone first), so it stops
at 40 tokens whatever the model. Reports completed / refused and the peak number of
requests streaming at once (between their first token and their end).

storm: N concurrent greedy requests whose whole lengths need about 3.3x the decode pool
(the pool at 30% of demand): every request must complete with the tokens it gets alone
(unpreempted: run one at a time first), the decode counts its preemptions, and the mesh
ends with no page used on any member.

    python -m bench.preemption capacity [--model tiny]
    python -m bench.preemption storm [--model smollm2] [--requests 12] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import grpc

from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import Mesh, start_mesh, wait_quiet

PAGE = 16
WORDS = ("river engine harbour lantern meadow copper signal orchard thunder violet "
         "granite willow ember falcon cedar marble").split()


def prompt_of(i: int, n_words: int = 24) -> str:
    return "Tell a story about " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)]
                                            for k in range(n_words))


@dataclass
class Outcome:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    done: Done | None = None
    error: str | None = None
    first_at: float | None = None
    end_at: float | None = None


async def one(mesh: Mesh, prompt: str, max_tokens: int, stop: list[str] | None = None,
              ignore_eos: bool = False, timeout: float = 600) -> Outcome:
    out = Outcome()
    try:
        async with GenerateClient(mesh.router, timeout=timeout) as client:
            async for item in client.generate(prompt=prompt, max_tokens=max_tokens,
                                              stop=stop, ignore_eos=ignore_eos):
                if isinstance(item, Piece):
                    if out.first_at is None:
                        out.first_at = time.monotonic()
                    out.ids += item.token_ids
                    out.text += item.text
                else:
                    out.done = item
    except grpc.aio.AioRpcError as e:
        out.error = e.code().name
    out.end_at = time.monotonic()
    return out


async def concurrently(mesh: Mesh, jobs: list[dict]) -> list[Outcome]:
    results: list[Outcome] = [Outcome()] * len(jobs)

    async def run(i: int) -> None:
        results[i] = await one(mesh, **jobs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(jobs)):
            tg.start_soon(run, i)
    return results


def peak_streaming(outcomes: list[Outcome]) -> int:
    """Most requests between their first token and their end at any one moment."""
    edges = sorted([(o.first_at, 1) for o in outcomes if o.first_at is not None]
                   + [(o.end_at, -1) for o in outcomes if o.first_at is not None])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def decode_counter(mesh: Mesh, key: str) -> int:
    return sum(m[key] or 0 for m in mesh.status()["members"] if m["role"] == "decode")


async def blocking(fn, *args):
    """A blocking mesh helper (they run their own event loop) off this one."""
    return await anyio.to_thread.run_sync(fn, *args)


def mesh_with(tmp: Path, model: str, pages: int, reserve: str) -> Mesh:
    tmp.mkdir(parents=True, exist_ok=True)
    return start_mesh(tmp, model=model, timeout=300, up_args=[
        "--decode-kv-pages", str(pages), "--decode-args", f"--kv-reserve {reserve}"])


async def capacity(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-capacity-"))
    prompts = [prompt_of(i) for i in range(args.requests)]
    # Each request's stop string: the text of its own first stop_after greedy tokens,
    # measured alone on a roomy mesh.
    mesh = await blocking(mesh_with, tmp / "reference", args.model, 4096, "grow")
    try:
        refs = [await one(mesh, p, args.stop_after) for p in prompts]
    finally:
        await blocking(mesh.stop)
    longest = max(r.done.prompt_tokens for r in refs)
    pool = args.hold * -(-(longest + args.max_tokens) // PAGE)
    report: dict = {"model": args.model, "requests": args.requests,
                    "max_tokens": args.max_tokens, "stop_after": args.stop_after,
                    "prompt_tokens_max": longest, "pool_pages": pool,
                    "pool_holds_requests_at_max_tokens": args.hold, "results": {}}
    jobs = [{"prompt": p, "max_tokens": args.max_tokens, "stop": [r.text]}
            for p, r in zip(prompts, refs, strict=True)]
    for reserve in ("grow", "upfront"):
        mesh = await blocking(mesh_with, tmp / reserve, args.model, pool, reserve)
        try:
            started = time.monotonic()
            outcomes = await concurrently(mesh, jobs)
            wall = time.monotonic() - started
            quiet = await blocking(wait_quiet, mesh, 10.0)
            report["results"][reserve] = {
                "completed": sum(o.done is not None for o in outcomes),
                "refused": sum(o.error == "RESOURCE_EXHAUSTED" for o in outcomes),
                "other_errors": sorted({o.error for o in outcomes
                                        if o.error not in (None, "RESOURCE_EXHAUSTED")}),
                "completion_tokens": sorted({o.done.completion_tokens for o in outcomes
                                             if o.done}),
                "peak_streaming": peak_streaming(outcomes),
                "preemptions": await blocking(decode_counter, mesh, "preemptions_total"),
                "pages_used_after": sum(m["kv_pages_used"] or 0 for m in quiet["members"]),
                "wall_seconds": round(wall, 2),
            }
        finally:
            await blocking(mesh.stop)
    results = report["results"]
    report["concurrency_ratio"] = round(
        results["grow"]["peak_streaming"] / max(1, results["upfront"]["peak_streaming"]), 2)
    return report


async def storm(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-storm-"))
    prompts = [prompt_of(i, args.prompt_words) for i in range(args.requests)]
    # Size the pool from the prompts' token counts, measured on a first roomy mesh.
    mesh = await blocking(mesh_with, tmp / "measure", args.model, 4096, "grow")
    try:
        lengths = [(await one(mesh, p, 1)).done.prompt_tokens for p in prompts]
    finally:
        await blocking(mesh.stop)
    need = [-(-(n + args.max_tokens) // PAGE) for n in lengths]
    pool = max(max(need), round(args.fraction * sum(need)))
    mesh = await blocking(mesh_with, tmp / "storm", args.model, pool, "grow")
    try:
        # Unpreempted: one at a time, each fits the pool alone.
        alone = [await one(mesh, p, args.max_tokens, ignore_eos=True) for p in prompts]
        assert await blocking(decode_counter, mesh, "preemptions_total") == 0
        started = time.monotonic()
        together = await concurrently(mesh, [
            {"prompt": p, "max_tokens": args.max_tokens, "ignore_eos": True} for p in prompts])
        wall = time.monotonic() - started
        quiet = await blocking(wait_quiet, mesh, 10.0)
        return {
            "model": args.model, "requests": args.requests, "max_tokens": args.max_tokens,
            "pool_pages": pool, "demand_pages": sum(need),
            "pool_fraction_of_demand": round(pool / sum(need), 3),
            "completed": sum(o.done is not None for o in together),
            "errors": sorted({o.error for o in together if o.error}),
            "preemptions": await blocking(decode_counter, mesh, "preemptions_total"),
            "tokens_equal_unpreempted": sum(a.ids == t.ids for a, t in zip(alone, together,
                                                                           strict=True)),
            "distinct_tokens": len({t for o in alone for t in o.ids}),
            "pages_used_after": sum(m["kv_pages_used"] or 0 for m in quiet["members"]),
            "inflight_after": sum(m["inflight"] or 0 for m in quiet["members"]),
            "wall_seconds": round(wall, 2),
        }
    finally:
        await blocking(mesh.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    cap = sub.add_parser("capacity")
    cap.add_argument("--model", default="tiny")
    cap.add_argument("--requests", type=int, default=40)
    cap.add_argument("--max-tokens", type=int, default=1024)
    cap.add_argument("--stop-after", type=int, default=40)
    cap.add_argument("--hold", type=int, default=8, help="requests' max_tokens the pool holds")
    st = sub.add_parser("storm")
    st.add_argument("--model", default="tiny")
    st.add_argument("--requests", type=int, default=12)
    st.add_argument("--max-tokens", type=int, default=160)
    st.add_argument("--prompt-words", type=int, default=24)
    st.add_argument("--fraction", type=float, default=0.3, help="pool / demand")
    args = parser.parse_args()
    report = anyio.run(capacity if args.mode == "capacity" else storm, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
