"""NVFP4 KV on the wire, on a GPU: what packing and unpacking one prefill chunk's pages
costs, the Triton kernels (what a member runs) against the torch reference.

One chunk is the prefill's default 512 tokens (32 pages of 16) of a Llama-3-8B KV page
(32 layers, 8 KV heads, head_dim 128: 2 MiB a page in bf16), scattered through a pool
as a request's pages are. ``pack`` is KvWire.pack (encode, then the device settled, as
before a write); ``unpack`` is the decode's KvWire.unpack, synchronized. Median of
``--reps`` after a warm-up; the read rate counts the pool bytes read (pack) or written
(unpack) over the time.

    python -m bench.kv_wire_bench [--pages 32] [--reps 20] [--out bench-results/kv_wire.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from libs.engine.config import ModelConfig
from libs.transfer import KvWire


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32, help="pages a chunk (16 tokens each)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="bench-results/kv_wire.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_wire_bench needs a CUDA device")
    config = ModelConfig.llama3_8b()
    num_pages = 4 * args.pages
    shape = (num_pages, config.n_layers, 2, config.n_kv_heads, 16, config.head_dim)
    pool = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    wire = KvWire("nvfp4", pool)
    pages = torch.randperm(num_pages)[: args.pages].tolist()
    index = torch.tensor(pages, device="cuda")
    fmt = wire.format
    page_bytes = pool[0].numel() * pool.element_size()

    def reference_pack() -> None:
        wire.region[index] = fmt.encode(pool[index], 9)

    def reference_unpack() -> None:
        pool[index] = fmt.decode(wire.region[index], pool.dtype)

    rows = {
        "pack, kernels": _time(lambda: wire.pack(pages, 9), args.reps),
        "pack, torch reference": _time(reference_pack, args.reps),
        "unpack, kernels": _time(lambda: wire.unpack(pages), args.reps),
        "unpack, torch reference": _time(reference_unpack, args.reps),
    }
    card = torch.cuda.get_device_name()
    kv_bytes = args.pages * page_bytes
    print(f"{card}: {args.pages} pages of Llama-3-8B KV, {kv_bytes / 1e6:.1f} MB bf16 -> "
          f"{args.pages * fmt.slot_bytes / 1e6:.1f} MB on the wire")
    print(f"{'case':<26}{'time':>10}{'GB/s of bf16 KV':>18}")
    for name, seconds in rows.items():
        print(f"{name:<26}{seconds * 1e3:>8.3f} ms{kv_bytes / seconds / 1e9:>18.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": card, "pages": args.pages, "kv_bytes": kv_bytes,
                               "wire_bytes": args.pages * fmt.slot_bytes,
                               "seconds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
