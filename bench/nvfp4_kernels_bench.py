"""Benchmark the Triton NVFP4 kernels on one CUDA GPU: prints a table, writes JSON.

    python -m bench.nvfp4_kernels_bench [--out DIR] [--quick] [--tune] [--rounds R]
                                        [--stream-baseline F]

What is measured (all in one run, so the ceilings and the kernels share the card's state):
- Copy ceiling: `dst.copy_(src)` of 1 GiB, bytes read + written.
- quantize / dequantize (the Triton kernels, called through triton_impl so the public API's
  input checks, which synchronize, stay out of the time) on a 8192 x 8192 tensor: GB/s of
  bytes read + written, as % of the copy, and against the torch reference run on the GPU.
  quantize's bytes: x + packed + scales; dequantize's: packed + scales + output.
- nvfp4_linear (triton_impl.linear) against torch's bf16 F.linear on the same x, for
  M = 1, 16, 64, 256 rows of x and weights [N, K] (N output features, K input features).

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
from libs.kernels.nvfp4 import linear_kernels as lk
from libs.kernels.nvfp4 import reference, triton_impl
from libs.kernels.nvfp4.gemm_configs import head_config

L2_FLUSH_BYTES = 192 * 2**20
TUNE_M = (1, 64, 256)  # --tune-m: the token counts --tune times alternatives for
BASELINE = None  # --baseline: another linear_kernels module, timed beside the current one
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
    becomes a memcpy node that ran at only ~2.7 TB/s on an H200, below what the kernels
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


def stream_bench(copy_gbs: float, results: dict, tune: bool) -> list[str]:
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
            if tune and op == "quantize":  # blocks per tile x warps x programs per SM
                for blocks, warps in ((64, 2), (128, 4), (256, 8), (128, 2), (256, 4)):
                    for per_sm in (2, 4, 8, 16, 32):
                        t = graph_time_ms([lambda a=(x, s2, blocks, warps, per_sm):
                                           triton_impl._quantize(*a)] * 10)
                        results["stream_tune"].append(dict(op=op, dtype=name, blocks=blocks,
                                                           warps=warps, per_sm=per_sm,
                                                           us=t * 1e3, gbs=nbytes / t / 1e6))
            elif tune:  # blocks per program x warps
                args = (packed, scales, s2, dtype)
                for blocks in (64, 128, 256, 512):
                    for warps in (2, 4, 8):
                        if blocks < 32 * warps:
                            continue
                        t = graph_time_ms([lambda a=args, b=blocks, w=warps:
                                           triton_impl._dequantize(*a, b, w)] * 10)
                        results["stream_tune"].append(dict(op=op, dtype=name, blocks=blocks,
                                                           warps=warps, us=t * 1e3,
                                                           gbs=nbytes / t / 1e6))
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


def linear_bench(shapes, ms_list, results: dict, tune: bool, rounds: int = 1) -> list[str]:
    rows = []
    for label, n, k in shapes:
        bf16_bytes = n * k * 2
        fp4_bytes = n * k // 2 + n * k // 16
        n_bf16 = max(1, math.ceil(L2_FLUSH_BYTES / bf16_bytes))
        n_fp4 = max(2, math.ceil(L2_FLUSH_BYTES / fp4_bytes))
        copies = max(n_bf16, n_fp4)
        reps_per_graph = max(copies, 8)
        ws, qs = weight_copies(n, k, copies)
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
            kernel, cfg = lk.route(x, qs[0][0], qs[0][1], torch.empty(m, n, device="cuda",
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
            if tune and m in TUNE_M and (m < 64 or n * k >= 4096 * 4096):
                entry["tune"] = tune_configs(x, qs, n_fp4, reps_per_graph, m, n, k)
            results["linear"].append(entry)
            rows.append(f"| {label} | {n}x{k} | {m:3d} | {t_bf16 * 1e3:8.1f} us "
                        f"| {t_fp4 * 1e3:8.1f} us | {t_bf16 / t_fp4:5.2f}x | {gbs:6.0f} GB/s "
                        f"| {kernel} |" + base_txt
                        + (f" {ratios[0]:.2f}x-{ratios[-1]:.2f}x over {rounds} rounds |"
                           if rounds > 1 else ""))
        del ws, qs
        torch.cuda.empty_cache()
    return rows


def _time_gluon(gk, named_cfgs, pick, x, qs, n_fp4, reps, m, n, k):
    """Time gluon module gk's launch over (name, cfg) pairs, each checked against the
    reference on the first weight copy; the picked config is marked."""
    from triton.runtime.errors import OutOfResources  # where a config's tile cannot fit

    y_ref = reference.linear(x, qs[0][0], qs[0][1], qs[0][2], None).float()
    out = []
    for name, cfg in named_cfgs:
        def call(q, cfg=cfg):
            o = torch.empty(m, n, device="cuda", dtype=x.dtype)
            gk.launch(x, q[0], q[1], q[2], None, o, cfg)
            return o

        try:
            o = call(qs[0])
        except OutOfResources as err:  # e.g. a 256-token tile with the pick's ring depth
            out.append(dict(name=name, cfg=cfg, skipped=str(err)))
            print(f"tune [{n}x{k}] M={m}: {name} skipped: {err}", flush=True)
            continue
        rel = ((o.float() - y_ref).norm() / y_ref.norm()).item()
        t = graph_time_ms([(lambda q=qs[i % n_fp4]: call(q)) for i in range(reps)])
        name += " (picked)" if cfg == pick else ""
        out.append(dict(name=name, cfg=cfg, us=t * 1e3, rel_err=rel))
        print(f"tune [{n}x{k}] M={m}: {name} {t * 1e3:.1f} us rel_err {rel:.1e}", flush=True)
    return out


def tune_gemv(x, qs, n_fp4, reps, m, n, k):
    """Time the Gluon GEMV (gemv_kernel.py) over tile shapes and K splits: the sweep behind
    gemv_configs.pick_config. Returns [] where it cannot run (more than 8 tokens, K not a
    multiple of 512, a Triton without Gluon)."""
    try:
        from libs.kernels.nvfp4 import gemv_kernel as gk
    except ImportError:
        return []
    pick = gk.pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    cfgs = []
    for bn, warps in ((128, 8), (64, 4), (128, 4), (256, 8)):
        for split in (1, 2, 4, 8, 16):
            cfg = dict(BN=bn, BM=8, NBYTES=16, SPLIT_K=split, num_warps=warps)
            if m <= 8 and gk.fits(m, k, cfg) and 66 <= math.ceil(n / bn) * split <= 1056:
                cfgs.append((f"gemv-bn{bn}-w{warps}-split{split}", cfg))
    return _time_gluon(gk, cfgs, pick, x, qs, n_fp4, reps, m, n, k)


def tune_gemm(x, qs, n_fp4, reps, m, n, k):
    """Time the warp-specialized Gluon GEMM (gemm_kernel.py) with the picked token tile (and
    128 and 256 above 128 tokens) and K split in one, two and four: the sweep behind
    gemm_kernel.pick_config. Returns [] where it does not apply (16 tokens or fewer, small
    layers)."""
    try:
        from libs.kernels.nvfp4 import gemm_kernel as gk
    except ImportError:
        return []
    pick = gk.pick_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    if pick is None:
        return []
    pick = head_config(pick)  # one launch: a two-launch pick's first
    cfgs = []
    for bm in sorted({pick["BM"], 128, 256} if m > 128 else {pick["BM"]}):
        for split in (1, 2, 4):
            cfg = dict(pick, BM=bm, SPLIT_K=split, maxnreg=232 if bm > 128 else 128)
            if bm == 256:  # pick_config's ring for 256-token tiles (shared memory)
                cfg["STAGES"] = 3
            if gk.fits(m, k, cfg):
                cfgs.append((f"gemm-bm{bm}-split{split}", cfg))
    return _time_gluon(gk, cfgs, pick, x, qs, n_fp4, reps, m, n, k)


def tune_configs(x, qs, n_fp4, reps, m, n, k):
    """Time a few alternative configs and both decodes (a modest, offline autotune), and
    the Gluon GEMV's or GEMM's configs where they apply."""
    gluon = tune_gemv(x, qs, n_fp4, reps, m, n, k) if m <= 8 else tune_gemm(x, qs, n_fp4,
                                                                          reps, m, n, k)
    base = lk.pick_config(m, n, k)
    variants = [dict(base, name="triton-picked")]
    if n * k < 4096 * 4096:  # launch-bound shapes: only fewer programs / less reduction
        variants.append(dict(base, SPLIT_K=1, name="split1"))
        variants.append(dict(base, SPLIT_K=1, BLOCK_K=64, name="split1-bk64"))
        asms = (True,)
    elif m <= 16:
        s = base["SPLIT_K"]
        asms = (True,)
        g = dict(base, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
        variants.append(dict(base, K_INTERLEAVE=True, name="interleave"))
        variants.append(dict(g, SPLIT_K=s * 2, K_INTERLEAVE=True, name="split*2-interleave"))
        variants.append(dict(g, BLOCK_K=64, SPLIT_K=s * 2, name="bk64-split*2"))
        variants.append(dict(g, BLOCK_K=64, SPLIT_K=s * 2, K_INTERLEAVE=True,
                             name="bk64-split*2-interleave"))
        variants.append(dict(g, BLOCK_N=64, BLOCK_K=256, num_stages=3, name="bn64-bk256"))
        variants.append(dict(g, BLOCK_N=64, BLOCK_K=256, num_stages=3, K_INTERLEAVE=True,
                             name="bn64-bk256-interleave"))
        variants.append(dict(g, BLOCK_N=256, num_warps=8, name="bn256w8"))
        variants.append(dict(g, BLOCK_K=256, num_warps=8, num_stages=3, SPLIT_K=max(1, s // 2),
                             name="bn128w8-bk256"))
        variants.append(dict(g, BLOCK_N=64, name="bn64"))
        variants.append(dict(g, BLOCK_N=64, K_INTERLEAVE=True,
                             name="bn64-interleave"))
    if n * k >= 4096 * 4096 and m > 16:
        asms = (True, False)
    out = []
    for v in variants:
        for asm in asms:
            cfg = {key: v[key] for key in v if key not in ("DECODE_ASM", "name")}

            def call(q, cfg=cfg, asm=asm):
                o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                lk.launch(x, q[0], q[1], q[2], None, o, cfg, decode_asm=asm)

            try:
                o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                lk.launch(x, qs[0][0], qs[0][1], qs[0][2], None, o, cfg, decode_asm=asm)
                y_ref = reference.linear(x, qs[0][0], qs[0][1], qs[0][2], None).float()
                rel = ((o.float() - y_ref).norm() / y_ref.norm()).item()
                t = graph_time_ms([(lambda q=qs[i % n_fp4]: call(q)) for i in range(reps)])
                out.append(dict(name=v["name"], asm=asm, cfg=cfg, us=t * 1e3, rel_err=rel))
                print(f"tune [{n}x{k}] M={m}: {v['name']} asm={asm} {t * 1e3:.1f} us "
                      f"rel_err {rel:.1e}", flush=True)
            except Exception as e:  # a config that does not compile or fit is skipped
                out.append(dict(name=v["name"], asm=asm, cfg=cfg, error=repr(e)[:200]))
    return gluon + out


def _load_module(name: str, path: str):
    """A kernel file of another version, as a module of libs.kernels.nvfp4 (so its relative
    imports resolve), to time beside the current one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    ap.add_argument("--quick", action="store_true", help="SmolLM2 and 4096^2 only")
    ap.add_argument("--tune", action="store_true", help="also time alternative configs")
    ap.add_argument("--tune-m", default="1,64,256", help="token counts --tune looks at")
    ap.add_argument("--stream-only", action="store_true", help="quantize/dequantize only")
    ap.add_argument("--linear-only", action="store_true", help="skip quantize/dequantize")
    ap.add_argument("--shapes", default="",
                    help="comma list of smollm2,square,large,engine,mid (engine: the fused "
                         "SmolLM2 layers the engine runs, wqkv 960x576 and gate_up 3072x576; "
                         "mid: 2-4M-weight layers, 2048x2048, 2048x1536, 4096x1024)")
    ap.add_argument("--ms", default="1,16,64,256",
                    help="token counts of the linear rows (the targets are at 1 and 256; "
                         "512 and more show long prompts)")
    ap.add_argument("--baseline", default="", help="another linear_kernels.py to time too")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each linear row this many times, torch and nvfp4 alternating; "
                         "the table gives medians and the range of the per-round speedups")
    ap.add_argument("--stream-baseline", default="",
                    help="another triton_impl.py whose quantize/dequantize are timed too")
    args = ap.parse_args(argv)
    import triton

    global TUNE_M
    TUNE_M = tuple(int(v) for v in args.tune_m.split(","))

    props = torch.cuda.get_device_properties(0)
    results = dict(device=props.name, sms=props.multi_processor_count,
                   torch=torch.__version__, triton=triton.__version__, stream=[], linear=[],
                   stream_tune=[],
                   decode_asm=lk.DECODE_ASM, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    t0 = time.time()
    copy_gbs = copy_bandwidth()
    results["copy_gbs"] = copy_gbs
    global STREAM_BASELINE
    if args.stream_baseline:
        STREAM_BASELINE = _load_module("libs.kernels.nvfp4._baseline_impl", args.stream_baseline)
    stream_rows = [] if args.linear_only else stream_bench(copy_gbs, results, args.tune)
    global BASELINE
    if args.baseline:
        BASELINE = _load_module("libs.kernels.nvfp4._baseline_lk", args.baseline)
    shapes = [("smollm2 q/o", 576, 576), ("smollm2 k/v", 192, 576),
              ("smollm2 gate/up", 1536, 576), ("smollm2 down", 576, 1536),
              ("square 4096", 4096, 4096)]
    if not args.quick:
        shapes.append(("large 8192x28672", 8192, 28672))
    if args.shapes:
        keep = args.shapes.split(",")
        shapes = [sh for sh in [("smollm2 q/o", 576, 576), ("smollm2 k/v", 192, 576),
                                ("smollm2 gate/up", 1536, 576), ("smollm2 down", 576, 1536),
                                ("square 4096", 4096, 4096), ("large 8192x28672", 8192, 28672),
                                ("engine wqkv", 960, 576), ("engine gate_up", 3072, 576),
                                ("mid 2048x2048", 2048, 2048), ("mid 2048x1536", 2048, 1536),
                                ("mid 4096x1024", 4096, 1024)]
                  if sh[0].split()[0] in keep]
    if args.stream_only:
        shapes = []
    ms_list = [int(v) for v in args.ms.split(",")]
    linear_rows = linear_bench(shapes, ms_list, results, args.tune, args.rounds)
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
    for t in results["stream_tune"]:
        print(f"tune {t['op']} {t['dtype']}: blocks={t['blocks']} warps={t['warps']} "
              f"per_sm={t.get('per_sm', '-')} "
              f"{t['us']:.1f} us {t['gbs']:.0f} GB/s ({100 * t['gbs'] / copy_gbs:.1f}%)")
    for e in results["linear"]:
        for t in e.get("tune", []):
            print(f"tune {e['shape']} M={e['m']}: {t['name']} asm={t.get('asm', '-')} "
                  f"{t.get('us', float('nan')):.1f} us {t.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
