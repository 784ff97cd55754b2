"""Where a decode step's GPU time goes: the kernels of one CUDA-graph step, by name.

Loads a model spec in each weight format asked for (random weights drawn on the GPU),
captures the decode graph of ``--batch``, times ``--steps`` steps (each ending in the
host copy of its greedy tokens, read from the graph's logits as the decode service reads
them: no copy, libs/engine/sampling.greedy_tokens), then profiles 10 steps with
torch's profiler and prints each kernel's time a step, largest first. Kernels inside a
CUDA graph replay show up one by one.

    python -m bench.decode_profile [--model random:llama3-8b] [--weights nvfp4,native]
        [--batch 1] [--context 64] [--top 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from libs.engine.engine import DecodeSeq, Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from libs.engine.sampling import greedy_tokens

PROFILED = 10


def profile_format(model: str, weights: str, batch: int, context: int, steps: int,
                   top: int) -> None:
    loaded = load_model(model, torch.device("cuda"), torch.bfloat16, weights)
    pages_each = -(-(context + steps + PROFILED + 8) // 16)
    pool = KvPool(loaded.config, batch * pages_each, 16, device="cuda", dtype=torch.bfloat16)
    engine = Engine(loaded.config, loaded.weights, pool, max_batch=batch,
                    max_context=pages_each * 16)
    engine.capture_decode_graphs(batch)
    seqs = [DecodeSeq(pool.alloc(pages_each), context, 5) for _ in range(batch)]

    def step() -> None:
        greedy_tokens(engine.decode_step(seqs, copy=False)).tolist()
        for s in seqs:
            s.pos += 1

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - started) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / PROFILED
    print(f"== {model}, {weights} weights, batch {batch}, context {context}: "
          f"step {wall * 1e3:.3f} ms wall, {total / 1e3:.3f} ms of kernels")
    for e in rows[:top]:
        if e.device_time_total:
            print(f"   {e.device_time_total / PROFILED:9.1f} us  {e.count // PROFILED:4d}x  "
                  f"{e.key[:96]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--weights", default="nvfp4,native", help="formats, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64, help="tokens before the first step")
    parser.add_argument("--steps", type=int, default=50, help="timed steps")
    parser.add_argument("--top", type=int, default=20, help="kernels to print")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile needs a CUDA device")
    with torch.inference_mode():
        for weights in args.weights.split(","):
            profile_format(args.model, weights, args.batch, args.context, args.steps,
                           args.top)
            torch.cuda.empty_cache()  # the format's weights and pool are gone by now


if __name__ == "__main__":
    main()
