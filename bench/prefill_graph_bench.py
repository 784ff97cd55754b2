"""One engine prefill pass on CUDA, eager against CUDA graphs, by pack shape.

Random SmolLM2-shaped weights (same speed as the real ones), fresh prompts packed as the
prefill member packs them. Two engines share the weights, each with its own pool: one
launches every kernel from Python (``cuda_graphs=False``), one replays the prefill graphs
captured for packs of up to ``--max-tokens``. Per shape, the best of ``--reps`` passes:

- host: until `Engine.prefill_batch` returns (launching, or packing and one replay);
- wall: until the device has finished the pass.

    python -m bench.prefill_graph_bench [--shapes 1x40,1x312,1x1024,6x312,2x1024]
        [--max-tokens 2048] [--reps 5] [--out bench-results/prefill_graphs.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from libs.engine.engine import Engine, PrefillSeq
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x40,1x312,1x512,1x1024,6x312,4x512,2x1024,16x128",
                        help="packs as PROMPTSxTOKENS")
    parser.add_argument("--max-tokens", type=int, default=2048, help="the pack budget")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="bench-results/prefill_graphs.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_graph_bench needs a CUDA device")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    loaded = load_model("random:smollm2", "cuda", torch.bfloat16)
    pages = 1 + sum(-(-n * length // 16) for n, length in shapes)
    engines, capture_s = {}, 0.0
    for name, graphs in (("eager", False), ("graphs", True)):
        pool = KvPool(loaded.config, pages, 16, device="cuda", dtype=torch.bfloat16)
        engines[name] = Engine(loaded.config, loaded.weights, pool, cuda_graphs=graphs)
        started = time.perf_counter()
        captured = engines[name].capture_prefill_graphs(args.max_tokens)
        if captured:
            capture_s = time.perf_counter() - started
            print(f"{len(captured)} prefill graphs captured in {capture_s:.2f} s")
        pool.alloc(1)  # page 0: where capture wrote
    rows = []
    for n, length in shapes:
        row = {"prompts": n, "tokens": length}
        for name, eng in engines.items():
            seqs = [PrefillSeq(list(range(100 + i, 100 + i + length)),
                               eng.pool.alloc(eng.pool.pages_for(length))) for i in range(n)]
            for _ in range(3):
                eng.prefill_batch(seqs)
            torch.cuda.synchronize()
            host, wall = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                eng.prefill_batch(seqs)
                host.append(time.perf_counter() - t)
                torch.cuda.synchronize()
                wall.append(time.perf_counter() - t)
            row[f"{name}_host_ms"], row[f"{name}_wall_ms"] = 1e3 * min(host), 1e3 * min(wall)
            for s in seqs:
                eng.pool.free(s.pages)
        row["graph_tok_s"] = n * length / row["graphs_wall_ms"] * 1e3
        rows.append(row)
        print(f"{n:>3} x {length:<5} eager host {row['eager_host_ms']:6.2f} wall "
              f"{row['eager_wall_ms']:6.2f} ms | graphs host {row['graphs_host_ms']:5.2f} wall "
              f"{row['graphs_wall_ms']:5.2f} ms ({row['graph_tok_s']:,.0f} tok/s)", flush=True)
    result = {"bench": "prefill_graphs", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "model": "random:smollm2", "dtype": "bfloat16",
              "max_tokens": args.max_tokens, "reps": args.reps, "capture_s": capture_s,
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
