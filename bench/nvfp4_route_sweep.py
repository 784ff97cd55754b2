"""Which kernel and config is fastest for one NVFP4 layer shape at decode batches? Prints a
table, writes JSON.

    python -m bench.nvfp4_route_sweep [--out DIR] [--shapes llama1b] [--ms 1,128,64,32,8,4,16]
                                      [--time-budget S]

The routing table (libs/kernels/nvfp4/routing.py) picks one kernel and config per call
from rules measured on some shapes; this script times the alternatives on others. For
each shape and token count it times, in nvfp4_kernels_bench's harness (CUDA graphs of
back-to-back calls over enough weight copies that every call reads HBM):

- torch's bf16 F.linear (the baseline) and the call as routed;
- the GEMV (gemv_kernel.py, up to 8 tokens) in the config its rules give past their guard
  on the layer's size (gemv_configs.layer_config) and in neighbouring tiles, K splits,
  K slices and x staging;
- the Triton kernel in its config and other row tiles and K splits;
- the GEMM (gemm_kernel.py, 16 tokens and more) in its large-layer config
  (gemm_configs.layer_config) and other K splits and token tiles;
- dequantize + cuBLAS (16 tokens and more).

Every candidate's output is checked against the dequantize route's (relative error under
1e-2); one that fails to build or is wrong is reported, not timed. The JSON is rewritten
after each shape and token count, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.nvfp4_kernels_bench import SHAPES, StreamedWeights, graph_time_ms
from libs.kernels.nvfp4 import gemm_configs, gemv_configs, linear, triton_configs
from libs.kernels.nvfp4.common import sm_count
from libs.kernels.nvfp4.grid import cdiv


def gemv_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """The GEMV's configs for the call: its rules' pick and neighbouring tiles, K splits,
    K slices and x staging that fit."""
    base = dict(BM=8, NBYTES=16, SPLIT_K=1)
    cands = []
    if m == 1:
        for w in (4, 8):
            for rows in (16, 32):
                cands.append(dict(base, BN=rows * w, SLICES=w, num_warps=w))
        for bn in (32, 64):
            for split in (1, 2, 4, 8, 16):
                cands.append(dict(base, BN=bn, SPLIT_K=split, num_warps=bn // 16,
                                  X_SMEM=True))
    for bn, w in ((64, 4), (128, 8), (256, 8)):
        for split in (1, 2, 4, 8, 16):
            cands.append(dict(base, BN=bn, SPLIT_K=split, num_warps=w))
    picked = gemv_configs.layer_config(m, n, k, sms)
    fitting = [c for c in cands if gemv_configs.fits(m, k, c) and c != picked]
    return ([picked] if picked else []) + fitting


def triton_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """The Triton kernel's config for the call, and half and twice its row tile and K
    split."""
    picked = triton_configs.pick_config(m, n, k, sms)
    steps = cdiv(k, picked["BLOCK_K"])
    cands = [picked]
    for bn in {picked["BLOCK_N"] // 2, picked["BLOCK_N"], picked["BLOCK_N"] * 2} & {32, 64, 128}:
        for split in (picked["SPLIT_K"] // 2, picked["SPLIT_K"], picked["SPLIT_K"] * 2):
            cfg = dict(picked, BLOCK_N=bn, SPLIT_K=split)
            if split >= 1 and steps % split == 0 and cfg not in cands:
                cands.append(cfg)
    return cands


def gemm_candidates(m: int, n: int, k: int, sms: int) -> list[dict]:
    """The GEMM's large-layer config for the call and other K splits and token tiles."""
    picked = gemm_configs.layer_config(m, n, k, sms)
    if picked is None or "HEAD" in picked:
        return []
    cands = [picked]
    for bm in (b for b in (16, 32, 64, 128) if b <= 2 * m):
        for split in (1, 2, 4, 8):
            cfg = dict(picked, BM=bm, SPLIT_K=split, maxnreg=128)
            if gemm_configs.fits(m, k, cfg) and cfg not in cands:
                cands.append(cfg)
    return cands


def candidates(m: int, n: int, k: int, sms: int) -> list[tuple[str, dict]]:
    out = []
    if m <= 8:
        out += [("gemv", c) for c in gemv_candidates(m, n, k, sms)]
    if m <= 32:
        out += [("triton", c) for c in triton_candidates(m, n, k, sms)]
    if m >= 16:
        out += [("gemm", c) for c in gemm_candidates(m, n, k, sms)]
        out.append(("dequantize", {}))
    return out


def _call(kernel: str, cfg: dict, x, q, out):
    packed, scales, s2 = q
    if kernel == "dequantize":
        return lambda: linear.dequantize_linear(x, packed, scales, s2, None)
    module = linear.kernel_module(kernel)
    return lambda: module.launch(x, packed, scales, s2, None, out, cfg)


def sweep_row(label: str, n: int, k: int, m: int, weights: StreamedWeights, sms: int) -> dict:
    """Every candidate for [m, k] x [n, k]^T timed (or its error), with torch's bf16."""
    ws, qs, reps = weights.ws, weights.qs, weights.reps
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = linear.dequantize_linear(x, *qs[0], None).float()
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    t_bf16 = graph_time_ms([(lambda w=ws[i % weights.n_bf16]: torch.nn.functional.linear(x, w))
                            for i in range(reps)]) * 1e3
    routed = linear.route(x, qs[0][0], qs[0][1], outs[0])
    cands = candidates(m, n, k, sms)
    if routed not in cands:  # the route's own pick is always timed
        cands.insert(0, routed)
    rows = []
    for kernel, cfg in cands:
        row = dict(kernel=kernel, config=cfg, routed=(kernel, cfg) == routed)
        try:
            got = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            result = _call(kernel, cfg, x, qs[0], got)()
            got = result if kernel == "dequantize" else got
            rel = ((got.float() - want).norm() / want.norm()).item()
            if not rel < 1e-2:
                row["error"] = f"wrong: relative error {rel:.3g}"
            else:
                row["us"] = graph_time_ms([_call(kernel, cfg, x, qs[i % weights.n_fp4], outs[i])
                                           for i in range(reps)]) * 1e3
        except Exception as exc:  # a config this kernel cannot build: say so, go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    routed_us = next((r["us"] for r in rows if r["routed"] and "us" in r), None)
    return dict(shape=label, n=n, k=k, m=m, bf16_us=t_bf16, routed=list(routed),
                routed_us=routed_us, best=timed[0] if timed else None,
                nvfp4_bytes=weights.nvfp4_bytes, candidates=rows)


def print_row(entry: dict) -> None:
    best, routed_us = entry["best"], entry["routed_us"]
    label, n, k, m, t_bf16 = (entry[key] for key in ("shape", "n", "k", "m", "bf16_us"))
    if best:
        gbs = entry["nvfp4_bytes"] / best["us"] / 1e3
        routed_txt = f"{routed_us:7.2f}" if routed_us is not None else "    n/a"
        print(f"| {label} | {n}x{k} | {m:3d} | {t_bf16:7.2f} | {entry['routed'][0]:10s} "
              f"{routed_txt} | {best['kernel']:10s} {best['us']:7.2f} ({gbs:5.0f} GB/s) "
              f"| {t_bf16 / best['us']:5.2f}x | {best['config']} |", flush=True)
    timed = sorted((r for r in entry["candidates"] if "us" in r), key=lambda r: r["us"])
    for r in timed[1:4]:
        print(f"|   next: {r['kernel']} {r['us']:.2f} us {r['config']}", flush=True)
    bad = [r for r in entry["candidates"] if "error" in r]
    if bad:
        print(f"|   {len(bad)} candidates not timed, e.g. {bad[0]['kernel']} "
              f"{bad[0]['config']}: {bad[0]['error']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results", help="directory for the JSON")
    parser.add_argument("--shapes", default="llama1b",
                        help="comma list of nvfp4_kernels_bench's shape groups, or NxK pairs")
    parser.add_argument("--ms", default="1,128,64,32,8,4,16",
                        help="token counts, in the order swept")
    parser.add_argument("--time-budget", type=float, default=600.0,
                        help="seconds; stop starting new rows past it")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nvfp4_route_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.time_budget
    shapes = []
    for item in args.shapes.split(","):
        if "x" in item and item.replace("x", "").isdigit():
            n, k = (int(v) for v in item.split("x"))
            shapes.append((item, n, k))
        else:
            shapes += [sh for sh in SHAPES if sh[0].split()[0] == item]
    ms = [int(v) for v in args.ms.split(",")]
    sms = sm_count(torch.device("cuda"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "nvfp4_route_sweep.json")
    results: list = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sms=sms)

    def write():
        with open(path, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)

    print(f"# {meta['device']}, {sms} SMs; times in us per call; best = fastest NVFP4 candidate")
    print("| shape | N x K | M | bf16 | routed | best | bf16 / best | best config |")
    print("|---|---|---|---|---|---|---|---|")
    weights = {}
    for m in ms:  # token counts outer: a run cut short has every shape at the first ones
        for label, n, k in shapes:
            if time.monotonic() > deadline:
                print(f"time budget spent: {label} at m={m} and after not swept", flush=True)
                write()
                return 0
            if label not in weights:
                weights[label] = StreamedWeights(n, k)
            results.append(sweep_row(label, n, k, m, weights[label], sms))
            write()
            print_row(results[-1])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
