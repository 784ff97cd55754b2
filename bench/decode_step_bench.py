"""One engine decode step on CUDA, eager against CUDA graphs, by batch size.

Random SmolLM2-shaped weights (same speed as the real ones), every sequence at the same
context (its KV random), one token each per step. The two engines share the weights and
the pool; their rounds alternate, the best round of each counts. Columns:

- eager: `Engine.decode_step` with ``cuda_graphs=False`` (paged Triton attention, each
  kernel launched from Python);
- graph: `Engine.decode_step(copy=False)` through the CUDA graphs: packing the step's
  inputs, one host-to-device copy, one replay;
- replay: the bucket's graph replayed alone, the floor the graph step's host work sits on.

    python -m bench.decode_step_bench [--batches 1,64,128] [--ctx 512] [--steps 50]
        [--dtype bfloat16] [--weights native|nvfp4] [--out bench-results/decode_step.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import DecodeSeq, Engine
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights
from libs.engine.nvfp4 import quantize_layer_linears


def _time(fn, steps: int) -> float:
    """Milliseconds a call, over `steps` calls, the GPU drained before and after."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,128")
    parser.add_argument("--ctx", type=int, default=512, help="tokens already in each sequence")
    parser.add_argument("--steps", type=int, default=50, help="decode steps a round")
    parser.add_argument("--reps", type=int, default=3, help="rounds of each engine")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--weights", default="native", choices=["native", "nvfp4"])
    parser.add_argument("--out", default="bench-results/decode_step.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_bench needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    cfg, ps = ModelConfig.smollm2(), 16
    weights = random_weights(cfg, 1234)  # random:smollm2 (loader.RANDOM_SEED), fewer imports
    if args.weights == "nvfp4":
        weights = quantize_layer_linears(weights)
    weights = weights.to("cuda", getattr(torch, args.dtype))
    per_seq = -(-(args.ctx + 1) // ps)
    pool = KvPool(cfg, per_seq * max(batches), ps, device="cuda", dtype=weights.dtype)
    pool.tensor.normal_()
    eager = Engine(cfg, weights, pool, cuda_graphs=False)
    graphed = Engine(cfg, weights, pool, max_batch=max(batches))
    started = time.perf_counter()
    graphed.capture_decode_graphs()
    capture_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        tokens = torch.randint(100, cfg.vocab_size, (batch,), generator=gen).tolist()
        seqs = [DecodeSeq(list(range(i * per_seq, (i + 1) * per_seq)), args.ctx, t)
                for i, t in enumerate(tokens)]
        assert graphed.graphs is not None
        graph = graphed.graphs.graphs[graphed.graphs.bucket(batch)][0]
        runs: dict[str, list[float]] = {"eager": [], "graph": [], "replay": []}
        calls = {
            "eager": lambda seqs=seqs: eager.decode_step(seqs),
            "graph": lambda seqs=seqs: graphed.decode_step(seqs, copy=False),
            "replay": graph.replay,
        }
        for fn in calls.values():
            _time(fn, 3)  # warm-up
        for _ in range(args.reps):
            for name, fn in calls.items():
                runs[name].append(_time(fn, args.steps))
        best = {name: min(r) for name, r in runs.items()}
        rows.append({"batch": batch, **{f"{k}_ms": v for k, v in best.items()},
                     "speedup": best["eager"] / best["graph"],
                     "graph_tok_s": batch / best["graph"] * 1e3, "runs_ms": runs})

    device = torch.cuda.get_device_name()
    print(f"{device}, random:smollm2 {args.dtype} {args.weights}, ctx {args.ctx}, "
          f"graphs captured in {capture_s:.2f} s")
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'replay ms':>9} {'speedup':>8} "
          f"{'graph tok/s':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} {r['replay_ms']:9.3f} "
              f"{r['speedup']:7.1f}x {r['graph_tok_s']:11.0f}")
    result = {
        "bench": "decode_step", "device": device, "torch": torch.__version__,
        "model": "random:smollm2", "dtype": args.dtype, "weights": args.weights,
        "ctx": args.ctx, "steps": args.steps, "reps": args.reps, "capture_s": capture_s,
        "rows": rows,
    }
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
