"""Tracing overhead: aggregate decode tokens/s of the same load with tracing off and on.

Two meshes of the same model run one at a time, alternating (off, on, off, on, ...), so
the machine's drift hits both. "off" exports nothing (OTEL_TRACES_EXPORTER=none); "on"
exports every span over OTLP/gRPC into the embedded trace store (`--trace-store`).

    python -m bench.tracing_overhead [--model smollm2] [--streams 16] [--tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import start_mesh


async def load(router: str, streams: int, tokens: int) -> float:
    """Aggregate generated tokens per second of `streams` concurrent requests."""
    counts = [0] * streams

    async def one(i: int) -> None:
        async with GenerateClient(router, timeout=600) as client:
            async for item in client.generate(prompt=f"{i} river engine harbour " * 20,
                                              max_tokens=tokens, ignore_eos=True):
                if isinstance(item, Piece):
                    counts[i] += len(item.token_ids)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i)
    return sum(counts) / (time.perf_counter() - started)


def measure(tmp: Path, model: str, traced: bool, streams: int, tokens: int) -> float:
    env = {"OTEL_BSP_SCHEDULE_DELAY": "500"}
    up_args = ["--trace-store", str(tmp / "traces.sqlite")] if traced else []
    if not traced:
        env["OTEL_TRACES_EXPORTER"] = "none"
    mesh = start_mesh(tmp, model=model, extra_env=env, up_args=up_args)
    try:
        anyio.run(load, mesh.router, streams, 4)  # warm-up
        return anyio.run(load, mesh.router, streams, tokens)
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench-results/tracing_overhead.json")
    args = parser.parse_args()
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    results: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.reps):
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory() as tmp:
                rate = measure(Path(tmp), args.model, mode == "on", args.streams, args.tokens)
            results[mode].append(rate)
            print(f"rep {rep + 1} tracing {mode:3}: {rate:7.1f} tok/s", flush=True)
    best = {mode: max(rates) for mode, rates in results.items()}
    ratio = best["on"] / best["off"]
    print(f"\n{'tracing':8} {'best tok/s':>10}  runs")
    for mode, rates in results.items():
        print(f"{mode:8} {best[mode]:10.1f}  {[round(r, 1) for r in rates]}")
    median = statistics.median(results["on"]) / statistics.median(results["off"])
    print(f"tracing on / off: best {ratio:.3f}, median {median:.3f} (1.0 = no cost; "
          f"target >= 0.95)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "tok_s": results, "ratio_best": ratio,
                               "ratio_median": median}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
