"""Prefill throughput by pack size: the same 16 chunks of 256 tokens, 4 per forward pass
(`--max-batch-tokens 1024`) against 2 per pass (512), alternating in one run.

A pack attends block-diagonally over its whole length, so attention cost grows with the
square of the pack; the weights stream once per pass either way. This measures which
wins on this machine. Random SmolLM2-shaped weights (same speed as the real ones).

    python -m bench.prefill_pack_bench [--reps 3] [--out bench-results/prefill_pack.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from libs.engine.engine import Engine, PrefillSeq  # noqa: E402
from libs.engine.kvpool import KvPool  # noqa: E402
from libs.engine.loader import load_model  # noqa: E402

CHUNKS, CHUNK = 16, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench-results/prefill_pack.json")
    args = parser.parse_args()
    loaded = load_model("random:smollm2")
    pool = KvPool(loaded.config, CHUNKS * CHUNK // 16, 16, dtype=loaded.weights.dtype)
    engine = Engine(loaded.config, loaded.weights, pool)
    gen = torch.Generator().manual_seed(0)
    seqs = [
        PrefillSeq(torch.randint(100, 40000, (CHUNK,), generator=gen).tolist(),
                   list(range(i * 16, i * 16 + 16)))
        for i in range(CHUNKS)
    ]

    def run(per_pass: int) -> float:
        started = time.perf_counter()
        for i in range(0, CHUNKS, per_pass):
            engine.prefill_batch(seqs[i : i + per_pass])
        return time.perf_counter() - started

    packs = {1024: 4, 512: 2}
    for per_pass in packs.values():
        run(per_pass)  # warm-up
    times: dict[int, list[float]] = {pack: [] for pack in packs}
    for _ in range(args.reps):
        for pack, per_pass in packs.items():
            times[pack].append(run(per_pass))
    print(f"{'pack tokens':>11} {'best s':>7} {'tok/s':>7}  runs")
    for pack, runs in times.items():
        print(f"{pack:>11} {min(runs):7.2f} {CHUNKS * CHUNK / min(runs):7.0f}  "
              f"{[round(r, 2) for r in runs]}")
    ratio = min(times[1024]) / min(times[512])
    print(f"throughput of 512-token packs / 1024-token packs: {ratio:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"times_s": times, "ratio_512_over_1024": ratio}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
