"""Benchmark the Triton NVFP4 kernels on one CUDA GPU: prints a table, writes JSON.

    python -m bench.nvfp4_kernels_bench [--out DIR] [--quick] [--shapes S] [--ms M]
                                        [--rounds R] [--baseline F] [--stream-baseline F]

What is measured (all in one run, so the ceilings and the kernels share the card's state):
- Copy ceiling: `dst.copy_(src)` of 1 GiB, bytes read + written.
- quantize / dequantize (the Triton kernels, called through triton_impl so the public API's
  input checks, which synchronize, stay out of the time) on a 8192 x 8192 tensor: GB/s of
  bytes read + written, as % of the copy, and against the torch reference run on the GPU.
  quantize's bytes: x + packed + scales; dequantize's: packed + scales + output.
- nvfp4_linear (triton_impl.linear) against torch's bf16 F.linear on the same x, for
  M = 1, 16, 64, 256 rows of x and weights [N, K] (N output features, K input features),
  with the kernel the route picked (libs/kernels/nvfp4/routing.py).

Timing: CUDA events around CUDA-graph replays, median of several replays after a warmup.
Each graph holds R back-to-back calls, so the time per call includes the launch gaps a
decode step would see inside a graph, but not Python's launch cost. For the linears, the R
calls cycle over enough distinct weight copies (>= 3x the 60 MB L2 of an H200 per graph) that
every call streams its weights from HBM, as in a real model where each layer's weights are
read once per step; without that, small weights would be timed from L2. With --rounds R each
linear row is timed R times, torch and nvfp4 alternating (bench/rounds.py says why); the
table then gives the medians and the range of the per-round speedups.
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

from bench.rounds import interleaved
from libs.kernels.nvfp4 import linear, reference, triton_impl

L2_FLUSH_BYTES = 192 * 2**20
BASELINE = None  # --baseline: another linear.py (the CUDA linear), timed beside this one
STREAM_BASELINE = None  # --stream-baseline: another triton_impl module, timed beside this one


def graph_time_ms(calls, reps: int = 7) -> float:
    """Median ms per call of `calls` (a list of zero-arg callables) captured in one graph."""
    for fn in calls[:4]:  # warm up: compile, allocate
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for fn in calls:
                fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def eager_time_ms(fn, reps: int = 3) -> float:
    """Median ms of single eager calls (for the slow torch reference, which also builds a
    small tensor from a Python list and so cannot be captured in a graph)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written, timed eagerly with events
    after a second of copies so the clocks have left idle. (Inside a CUDA graph the copy
    becomes a memcpy node that runs at only ~2.7 TB/s on an H200, below what the kernels
    here reach, so the eager copy, ~4.2 TB/s, is the ceiling used.)"""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        dst.copy_(src)
        torch.cuda.synchronize()
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 5)
    return 2 * src.numel() / statistics.median(times) / 1e6  # GB/s


def stream_bench(copy_gbs: float, results: dict) -> list[str]:
    rows = []
    n, k = 8192, 8192
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, k, device="cuda", dtype=dtype)
        s2 = reference.global_scale(x)
        elems = x.numel()
        q_bytes = elems * x.element_size() + elems // 2 + elems // 16
        d_bytes = elems // 2 + elems // 16 + elems * x.element_size()
        packed, scales = triton_impl.quantize(x, s2)
        # correctness spot check in the same run (the tests do it thoroughly)
        p_ref, s_ref = reference.quantize(x[:64].cpu(), s2.cpu())
        assert torch.equal(packed[:64].cpu(), p_ref)
        assert torch.equal(scales[:64].cpu().view(torch.uint8), s_ref.view(torch.uint8))
        name = str(dtype).replace("torch.", "")
        for op, fn, ref_fn, nbytes in (
            ("quantize", lambda x=x, s2=s2: triton_impl.quantize(x, s2),
             lambda x=x, s2=s2: reference.quantize(x, s2), q_bytes),
            ("dequantize",
             lambda p=packed, s=scales, s2=s2, d=dtype: triton_impl.dequantize(p, s, s2, d),
             lambda p=packed, s=scales, s2=s2, d=dtype: reference.dequantize(p, s, s2, d),
             d_bytes),
        ):
            ms = graph_time_ms([fn] * 10)
            ms_ref = eager_time_ms(ref_fn)
            gbs = nbytes / ms / 1e6
            results["stream"].append(dict(op=op, dtype=name, shape=[n, k], ms=ms, gbs=gbs,
                                          pct_copy=100 * gbs / copy_gbs, torch_ref_ms=ms_ref,
                                          speedup_vs_torch_ref=ms_ref / ms))
            rows.append(f"| {op} {name} [{n}x{k}] | {ms * 1e3:8.1f} us | {gbs:7.0f} GB/s "
                        f"| {100 * gbs / copy_gbs:5.1f}% | {ms_ref * 1e3:8.1f} us "
                        f"| {ms_ref / ms:5.1f}x |")
            if STREAM_BASELINE is not None:
                base = getattr(STREAM_BASELINE, op)
                args = (x, s2) if op == "quantize" else (packed, scales, s2, dtype)
                base_out = base(*args)
                this_out = fn()
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(base_out if op == "quantize" else [base_out],
                                           this_out if op == "quantize" else [this_out],
                                           strict=True))
                ms_base = graph_time_ms([lambda f=base, a=args: f(*a)] * 10)
                results["stream"][-1].update(baseline_ms=ms_base, baseline_same_bytes=same,
                                             speedup_vs_baseline=ms_base / ms)
                rows.append(f"| {op} {name} baseline | {ms_base * 1e3:8.1f} us "
                            f"| {nbytes / ms_base / 1e6:7.0f} GB/s "
                            f"| {100 * nbytes / ms_base / 1e6 / copy_gbs:5.1f}% "
                            f"| this kernel {ms_base / ms:4.2f}x faster | same bytes: {same} |")
    return rows


def weight_copies(n: int, k: int, count: int):
    """`count` independent bf16 weights and their NVFP4 quantizations."""
    ws, qs = [], []
    for i in range(count):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * (1 + i % 3)
        ws.append(w)
        s2 = reference.global_scale(w)
        qs.append((*triton_impl.quantize(w, s2), s2))
    return ws, qs


class StreamedWeights:
    """One [n, k] shape's bf16 weights and NVFP4 quantizations: enough copies of each that a
    graph of `reps` calls cycling over them (n_bf16 and n_fp4 apart) reads every call's
    weight from HBM, not L2."""

    def __init__(self, n: int, k: int):
        self.nvfp4_bytes = n * k // 2 + n * k // 16
        self.n_bf16 = max(1, math.ceil(L2_FLUSH_BYTES / (n * k * 2)))
        self.n_fp4 = max(2, math.ceil(L2_FLUSH_BYTES / self.nvfp4_bytes))
        self.reps = max(self.n_bf16, self.n_fp4, 8)
        self.ws, self.qs = weight_copies(n, k, max(self.n_bf16, self.n_fp4))


def linear_bench(shapes, ms_list, results: dict, rounds: int = 1) -> list[str]:
    rows = []
    for label, n, k in shapes:
        weights = StreamedWeights(n, k)
        ws, qs, reps_per_graph = weights.ws, weights.qs, weights.reps
        n_bf16, n_fp4, fp4_bytes = weights.n_bf16, weights.n_fp4, weights.nvfp4_bytes
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            # correctness spot check against the reference on the first copy
            y = triton_impl.linear(x, *qs[0][:2], qs[0][2], None)
            y_ref = reference.linear(x, qs[0][0], qs[0][1], qs[0][2], None)
            rel = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
            assert rel < 1e-2, (label, m, rel)
            call_lists = [
                [(lambda w=ws[i % n_bf16], x=x: torch.nn.functional.linear(x, w))
                 for i in range(reps_per_graph)],
                [(lambda q=qs[i % n_fp4], x=x: triton_impl.linear(x, q[0], q[1], q[2], None))
                 for i in range(reps_per_graph)]]
            if BASELINE is not None:
                call_lists.append(
                    [(lambda q=qs[i % n_fp4], x=x: BASELINE.linear(x, q[0], q[1], q[2], None))
                     for i in range(reps_per_graph)])
            timers = [(lambda calls=calls: graph_time_ms(calls)) for calls in call_lists]
            per_round = interleaved(timers, rounds)
            t_bf16, t_fp4 = (statistics.median(ts) for ts in per_round[:2])
            base_txt, t_base = "", None
            if BASELINE is not None:
                t_base = statistics.median(per_round[2])
                base_txt = f" {t_base * 1e3:8.1f} us (baseline) |"
            ratios = sorted(b / f for b, f in zip(*per_round[:2], strict=True))
            kernel, cfg = linear.route(x, qs[0][0], qs[0][1], torch.empty(m, n, device="cuda",
                                                                       dtype=x.dtype))
            gbs = (fp4_bytes + m * k * 2 + m * n * 2) / t_fp4 / 1e6
            entry = dict(shape=label, n=n, k=k, m=m, bf16_us=t_bf16 * 1e3, nvfp4_us=t_fp4 * 1e3,
                         speedup=t_bf16 / t_fp4, nvfp4_weight_gbs=gbs, kernel=kernel, config=cfg,
                         rel_err=rel)
            if t_base is not None:
                entry["baseline_us"] = t_base * 1e3
            if rounds > 1:
                entry["rounds"] = dict(bf16_us=[t * 1e3 for t in per_round[0]],
                                       nvfp4_us=[t * 1e3 for t in per_round[1]],
                                       speedup_min=ratios[0], speedup_max=ratios[-1])
            results["linear"].append(entry)
            rows.append(f"| {label} | {n}x{k} | {m:3d} | {t_bf16 * 1e3:8.1f} us "
                        f"| {t_fp4 * 1e3:8.1f} us | {t_bf16 / t_fp4:5.2f}x | {gbs:6.0f} GB/s "
                        f"| {kernel} |" + base_txt
                        + (f" {ratios[0]:.2f}x-{ratios[-1]:.2f}x over {rounds} rounds |"
                           if rounds > 1 else ""))
        del ws, qs
        torch.cuda.empty_cache()
    return rows


def _load_module(name: str, path: str):
    """A kernel file of another version, as a module of libs.kernels.nvfp4 (so its relative
    imports resolve), to time beside the current one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (label, N, K): the group is the label's first word, what --shapes names
SHAPES = [
    ("smollm2 q/o", 576, 576), ("smollm2 k/v", 192, 576),
    ("smollm2 gate/up", 1536, 576), ("smollm2 down", 576, 1536),
    ("square 4096", 4096, 4096), ("large 8192x28672", 8192, 28672),
    ("engine wqkv", 960, 576), ("engine gate_up", 3072, 576),
    ("mid 2048x2048", 2048, 2048), ("mid 2048x1536", 2048, 1536), ("mid 4096x1024", 4096, 1024),
    ("llama8b wqkv", 6144, 4096), ("llama8b wo", 4096, 4096),
    ("llama8b gate_up", 28672, 4096), ("llama8b down", 4096, 14336),
    ("llama1b wqkv", 3072, 2048), ("llama1b wo", 2048, 2048),
    ("llama1b gate_up", 16384, 2048), ("llama1b down", 2048, 8192),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    ap.add_argument("--quick", action="store_true", help="SmolLM2 and 4096^2 only")
    ap.add_argument("--stream-only", action="store_true", help="quantize/dequantize only")
    ap.add_argument("--linear-only", action="store_true", help="skip quantize/dequantize")
    ap.add_argument("--shapes", default="",
                    help="comma list of smollm2,square,large,engine,mid,llama8b,llama1b "
                         "(engine: the fused SmolLM2 layers the engine runs, wqkv 960x576 "
                         "and gate_up 3072x576; mid: 2-4M-weight layers, 2048x2048, "
                         "2048x1536, 4096x1024; llama8b, llama1b: the four layer linears "
                         "of Llama-3-8B's and Llama-3.2-1B's shapes as the engine runs them")
    ap.add_argument("--ms", default="1,16,64,256",
                    help="token counts of the linear rows (1: a decode step; 256: a decode batch "
                         "or prompt chunk; 512 and more show long prompts)")
    ap.add_argument("--baseline", default="",
                    help="another version of libs/kernels/nvfp4/linear.py to time too")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each linear row this many times, torch and nvfp4 alternating; "
                         "the table gives medians and the range of the per-round speedups")
    ap.add_argument("--stream-baseline", default="",
                    help="another triton_impl.py whose quantize/dequantize are timed too")
    args = ap.parse_args(argv)
    import triton

    props = torch.cuda.get_device_properties(0)
    results = dict(device=props.name, sms=props.multi_processor_count,
                   torch=torch.__version__, triton=triton.__version__, stream=[], linear=[],
                   time=time.strftime("%Y-%m-%d %H:%M:%S"))
    t0 = time.time()
    copy_gbs = copy_bandwidth()
    results["copy_gbs"] = copy_gbs
    global STREAM_BASELINE
    if args.stream_baseline:
        STREAM_BASELINE = _load_module("libs.kernels.nvfp4._baseline_impl",
                                       args.stream_baseline)
    stream_rows = [] if args.linear_only else stream_bench(copy_gbs, results)
    global BASELINE
    if args.baseline:
        BASELINE = _load_module("libs.kernels.nvfp4._baseline_lk", args.baseline)
    if args.shapes:
        groups = args.shapes.split(",")
    else:
        groups = ["smollm2", "square"] + ([] if args.quick else ["large"])
    shapes = [sh for sh in SHAPES if sh[0].split()[0] in groups]
    if args.stream_only:
        shapes = []
    ms_list = [int(v) for v in args.ms.split(",")]
    linear_rows = linear_bench(shapes, ms_list, results, args.rounds)
    results["seconds"] = time.time() - t0

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nvfp4_kernels_bench.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s (read + write); JSON in {path}")
    print("| kernel | time | GB/s | % of copy | torch reference on GPU | speedup |")
    print("|---|---|---|---|---|---|")
    print("\n".join(stream_rows))
    print("\nLinear: W is [N, K] (N outputs, K inputs), x is [M, K] bf16; per call, CUDA graph")
    extra = ((" baseline |" if args.baseline else "")
             + (" speedup per round |" if args.rounds > 1 else ""))
    print("| shape | N x K | M | torch bf16 | nvfp4 | speedup | nvfp4 bytes/s | kernel |" + extra)
    print("|---|---|---|---|---|---|---|---|" + "---|" * extra.count("|"))
    print("\n".join(linear_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
