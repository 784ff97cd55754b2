"""How fast can any kernel read an NVFP4 weight at one token? Prints a table, writes JSON.

    python -m bench.nvfp4_read_floor [--out DIR] [--shapes 4096x4096,8192x28672]

At M = 1 nvfp4_linear streams its weight (packed E2M1 bytes and e4m3 block scales) once,
so the time to move those bytes from HBM into the SMs, and nothing else, bounds it from
below. This script measures that floor in nvfp4_kernels_bench's harness (CUDA graphs of
back-to-back calls cycling over enough weight copies that every call reads HBM) beside
torch's bf16 F.linear, nvfp4_linear and an empty kernel, in interleaved rounds:

- "TMA read": each program copies its rows' bytes into shared memory by TMA, a ring of
  SLOTS boxes [rows, 256 B] kept in flight, or all of them at once under one barrier where
  they fit, and does nothing with them. Its mbarrier waits are armed with the byte count
  of every box (`mbarrier.expect`), so a program ends only after all its bytes landed.
  Bytes in flight do not need warps here, so one warp a program is enough; the sweep
  covers programs per call, rows a program and ring depth.
- the empty kernel: the graph's cost of a launch alone.

The 3x line at M = 1 is torch's time / 3 (three times torch's speed); the table says how
much of that a kernel has left once the bytes alone have arrived.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.nvfp4_kernels_bench import StreamedWeights, graph_time_ms
from libs.kernels.nvfp4 import triton_impl

BOX_BYTES = 256  # a TMA box's inner extent: at most 256 elements


@gluon.jit
def _tma_read(w_desc, s_desc, out_ptr, W_BOXES: gl.constexpr, S_BOXES: gl.constexpr,
              SLOTS: gl.constexpr, FIRST: gl.constexpr):
    """Copy program pid's rows of the packed weight (W_BOXES boxes wide) and of its scales
    (S_BOXES) into a ring of SLOTS shared buffers, SLOTS boxes in flight (FIRST: the
    boxes issued before the first wait, min(SLOTS, all)); write one word a lane."""
    R: gl.constexpr = w_desc.block_type.shape[0]
    row = gl.program_id(0) * R
    ring = gl.allocate_shared_memory(gl.uint8, [SLOTS] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(SLOTS):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    total: gl.constexpr = W_BOXES + S_BOXES
    for j in gl.static_range(FIRST):
        _issue(w_desc, s_desc, ring, bars, row, j, W_BOXES, SLOTS)
    for j in range(total):
        mbarrier.wait(bars.index(j % SLOTS), (j // SLOTS) & 1)
        if j + SLOTS < total:
            _issue(w_desc, s_desc, ring, bars, row, j + SLOTS, W_BOXES, SLOTS)
    for s in gl.static_range(SLOTS):
        mbarrier.invalidate(bars.index(s))
    _empty(out_ptr)


@gluon.jit
def _issue(w_desc, s_desc, ring, bars, row, j, W_BOXES: gl.constexpr, SLOTS: gl.constexpr):
    """Box j of the program's rows (packed boxes first, then scale boxes) into slot j % SLOTS."""
    B: gl.constexpr = w_desc.block_type.shape[1]  # BOX_BYTES
    bar = bars.index(j % SLOTS)
    mbarrier.expect(bar, w_desc.block_type.nbytes)
    if j < W_BOXES:
        tma.async_copy_global_to_shared(w_desc, [row, j * B], bar, ring.index(j % SLOTS))
    else:
        tma.async_copy_global_to_shared(s_desc, [row, (j - W_BOXES) * B], bar,
                                        ring.index(j % SLOTS))


@gluon.jit
def _tma_read_all(w_desc, s_desc, out_ptr, W_BOXES: gl.constexpr, S_BOXES: gl.constexpr):
    """Copy all of program pid's rows at once (every box in flight, one barrier): the
    fastest form where they fit in shared memory."""
    R: gl.constexpr = w_desc.block_type.shape[0]
    B: gl.constexpr = w_desc.block_type.shape[1]  # BOX_BYTES
    row = gl.program_id(0) * R
    w_smem = gl.allocate_shared_memory(gl.uint8, [W_BOXES] + w_desc.block_type.shape,
                                       w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [S_BOXES] + s_desc.block_type.shape,
                                       s_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), (W_BOXES + S_BOXES) * w_desc.block_type.nbytes)
    for c in gl.static_range(W_BOXES):
        tma.async_copy_global_to_shared(w_desc, [row, c * B], bar.index(0), w_smem.index(c))
    for c in gl.static_range(S_BOXES):
        tma.async_copy_global_to_shared(s_desc, [row, c * B], bar.index(0), s_smem.index(c))
    mbarrier.wait(bar.index(0), 0)
    mbarrier.invalidate(bar.index(0))
    _empty(out_ptr)


@gluon.jit
def _empty(out_ptr):
    """One word a lane: the whole of the empty kernel, and the read kernels' last act."""
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    gl.store(out_ptr + gl.program_id(0) * 32 + lanes, lanes)


def read_calls(qs, reps, rows, slots, out):
    """One graph's calls of _tma_read over the weight copies, `rows` rows a program (slots
    None: _tma_read_all)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    calls = []
    for i in range(reps):
        packed, scales = (t.view(torch.uint8) for t in qs[i % len(qs)][:2])
        n = packed.shape[0]
        w_desc = TensorDescriptor.from_tensor(packed, [rows, BOX_BYTES], layout)
        s_desc = TensorDescriptor.from_tensor(scales, [rows, BOX_BYTES], layout)
        w_boxes = math.ceil(packed.shape[1] / BOX_BYTES)
        s_boxes = math.ceil(scales.shape[1] / BOX_BYTES)
        if slots is None:
            calls.append(lambda w=w_desc, s=s_desc, wb=w_boxes, sb=s_boxes, g=n // rows:
                         _tma_read_all[(g,)](w, s, out, wb, sb, num_warps=1))
        else:
            calls.append(lambda w=w_desc, s=s_desc, wb=w_boxes, sb=s_boxes, g=n // rows:
                         _tma_read[(g,)](w, s, out, wb, sb, slots, min(slots, wb + sb),
                                         num_warps=1))
    return calls


def floor_shape(n: int, k: int, rounds: int) -> dict:
    """Every variant on an [n, k] weight at one token, `rounds` interleaved rounds."""
    weights = StreamedWeights(n, k)
    fp4_bytes, n_fp4, n_bf16, reps = (weights.nvfp4_bytes, weights.n_fp4, weights.n_bf16,
                                      weights.reps)
    ws, qs = weights.ws, weights.qs[:n_fp4]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8192 * 32, device="cuda", dtype=torch.int32)
    variants = {
        "torch bf16": [(lambda w=ws[i % n_bf16]: torch.nn.functional.linear(x, w))
                       for i in range(reps)],
        "nvfp4_linear": [(lambda q=qs[i % n_fp4]: triton_impl.linear(x, q[0], q[1], q[2], None))
                         for i in range(reps)],
        "empty, 256 programs": [(lambda: _empty[(256,)](out, num_warps=1))] * reps,
    }
    boxes = math.ceil(k // 2 / BOX_BYTES) + math.ceil(k // 16 / BOX_BYTES)
    for rows in (8, 16, 32, 64):
        for slots in (4, 8, 16, None):
            in_smem = (slots or boxes) * rows * BOX_BYTES
            if n % rows == 0 and n // rows <= 8192 and in_smem <= 160 * 1024:
                ring = f"{slots} slots" if slots else "all at once"
                variants[f"TMA read, {n // rows} programs x {rows} rows, {ring}"] = (
                    read_calls(qs, reps, rows, slots, out))
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, calls in variants.items():
            times[name].append(graph_time_ms(calls) * 1e3)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = min((name for name in med if name.startswith("TMA")), key=med.get)
    del ws, qs
    torch.cuda.empty_cache()
    return dict(n=n, k=k, fp4_bytes=fp4_bytes, us=times, median_us=med, best_read=best,
                target_us=med["torch bf16"] / 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    ap.add_argument("--shapes", default="4096x4096,8192x28672", help="comma list of NxK")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape")
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    results = dict(device=props.name, torch=torch.__version__,
                   time=time.strftime("%Y-%m-%d %H:%M:%S"), shapes=[])
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        r = floor_shape(n, k, args.rounds)
        results["shapes"].append(r)
        best = r["median_us"][r["best_read"]]
        print(f"\n{n}x{k} at M = 1 ({r['fp4_bytes'] / 1e6:.2f} MB of NVFP4 weight), us per "
              f"call, {args.rounds} interleaved rounds")
        print("| variant | rounds | median | GB/s of weight |")
        print("|---|---|---|---|")
        for name, ts in r["us"].items():
            print(f"| {name} | {' / '.join(f'{t:.2f}' for t in ts)} | {r['median_us'][name]:.2f}"
                  f" | {r['fp4_bytes'] / r['median_us'][name] / 1e3:.0f} |")
        print(f"3x target (torch / 3): {r['target_us']:.2f} us; best read alone "
              f"{best:.2f} us ({r['best_read']}), leaving {r['target_us'] - best:.2f} us; "
              f"nvfp4_linear {r['median_us']['nvfp4_linear']:.2f} us")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nvfp4_read_floor.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{props.name}; JSON in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
