"""Digests of nvfp4_linear's outputs on every routed shape class, to compare two pdmesh trees
bit for bit on one GPU.

Run from the root of the tree under test (PYTHONPATH=. makes its `libs` the one imported),
with this file's path, so one copy of the script checks any two trees:

    PYTHONPATH=. python3 /path/to/bench/nvfp4_digests.py --out new.json
    PYTHONPATH=. python3 /path/to/bench/nvfp4_digests.py --compare old.json new.json

For each (N, K, M) case, in bf16 (and fp16 for a subset): a seeded weight quantized on
the GPU (quantize_nvfp4), a seeded x, a bias at odd M; the sha256 of nvfp4_linear's output, whether
prepare_nvfp4_linear's output (planning call and replay) equals it, whether it is within the
kernels' bound of the exact product (or, on the dequantize route, equals reference.linear),
and the route's kernel name where the tree can say. Also the digests of quantize_nvfp4 and
dequantize_nvfp4 on a few tensors. Only the public API (libs.kernels) is needed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from libs.kernels import (
    dequantize_nvfp4,
    nvfp4_linear,
    prepare_nvfp4_linear,
    quantize_nvfp4,
)
from libs.kernels.nvfp4 import reference

ENGINE = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M as the engine runs it
ENGINE_M = [1, 3, 16, 32, 33, 64, 129, 200, 256, 449, 512, 600, 1024]
# (N, K, M): each route class's other forms, and Llama-8B-class layers
OTHER = [(4096, 4096, 1), (4096, 4096, 5), (4096, 4096, 12), (4096, 4096, 17),
         (4096, 4096, 100), (4096, 4096, 200), (4096, 4096, 256), (6144, 4096, 1),
         (6144, 4096, 64), (1024, 4096, 1), (1024, 4096, 20), (1024, 4096, 100),
         (4096, 14336, 1), (4096, 14336, 520), (8192, 28672, 1), (8192, 28672, 8),
         (8192, 28672, 16), (8192, 28672, 128), (1000, 8192, 1), (8192, 8192, 1),
         (300, 28672, 1), (4096, 11008, 1), (4096, 11008, 5), (4240, 576, 3), (192, 576, 40),
         (200, 576, 130), (64, 64, 5), (128, 64, 300), (960, 1536, 256), (576, 1280, 20),
         (200, 768, 40), (2048, 8192, 256), (8192, 2048, 300), (8192, 2048, 330),
         (2048, 8192, 9), (960, 2560, 48), (72, 1040, 3), (100, 48, 7), (2048, 2048, 32)]
FP16 = {(n, k, m) for n, k in ENGINE for m in (1, 64, 600, 1024)} | {
    (4096, 4096, 1), (4096, 4096, 17), (4096, 4096, 256), (1024, 4096, 100), (8192, 2048, 300)}


def cases() -> list[tuple[int, int, int, torch.dtype]]:
    """(N, K, M, dtype), grouped by weight."""
    shapes = [(n, k, m) for n, k in ENGINE for m in ENGINE_M] + OTHER
    out = [(n, k, m, torch.bfloat16) for n, k, m in shapes]
    out += [(n, k, m, torch.float16) for n, k, m in shapes if (n, k, m) in FP16]
    return sorted(out, key=lambda c: (c[0], c[1], str(c[3]), c[2]))


def route_name(x, packed, scales, out) -> str:
    """The kernel the tree routes this call to, under either tree's module name."""
    for module in ("linear", "linear_kernels"):
        try:
            mod = __import__(f"libs.kernels.nvfp4.{module}", fromlist=["route"])
            return mod.route(x, packed, scales, out)[0]
        except (ImportError, AttributeError):
            continue
    return "?"


def sha(t: torch.Tensor) -> str:
    flat = t.contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class Weight:
    """One seeded weight, quantized on the GPU, and its exact dequantized values."""

    def __init__(self, n: int, k: int, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        w = torch.randn(n, k, device="cuda", generator=g)
        w *= 10 ** torch.empty(n, 1, device="cuda").uniform_(-2, 1, generator=g)
        self.packed, self.scales, self.s2 = quantize_nvfp4(w.to(dtype))
        self.exact = reference.dequantize(self.packed, self.scales, self.s2,
                                          torch.float32).double()


def within_bound(y, x, wt: Weight, bias, dtype) -> bool:
    """y within the kernels' bound of the exact x @ W.T + bias (tests/kernels'
    check_linear_exact)."""
    exact = x.double() @ wt.exact.T + (bias.double() if bias is not None else 0)
    mag = x.double().abs() @ wt.exact.abs().T + (bias.double().abs() if bias is not None else 0)
    eps = 2.0**-8 if dtype is torch.bfloat16 else 2.0**-11
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2
    bound = (eps + x.shape[1] * 2.0**-22) * mag + tiny
    return bool(((y.double() - exact).abs() <= bound).all())


def one(wt: Weight, n: int, k: int, m: int, dtype: torch.dtype) -> dict:
    packed, scales, s2 = wt.packed, wt.scales, wt.s2
    gx = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gx).to(dtype).cuda()
    bias = torch.randn(n, generator=gx).to(dtype).cuda() if m % 2 else None
    kernel = route_name(x, packed, scales, torch.empty(m, n, device="cuda", dtype=dtype))
    y = nvfp4_linear(x, packed, scales, s2, bias)
    f = prepare_nvfp4_linear(packed, scales, s2, bias)
    prepared_equal = all(torch.equal(f(x), y) for _ in range(2))
    if kernel == "dequantize":
        exact = torch.equal(y, reference.linear(x, packed, scales, s2, bias))
    else:
        exact = within_bound(y, x, wt, bias, dtype)
    return dict(n=n, k=k, m=m, dtype=str(dtype).removeprefix("torch."), kernel=kernel,
                sha256=sha(y), weight_sha256=sha(packed) + sha(scales),
                prepared_equal=prepared_equal, exact=exact)


def stream() -> list[dict]:
    out = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = torch.Generator().manual_seed(5)
        x = (torch.randn(333, 4096, generator=g)
             * 10 ** torch.empty(333, 1).uniform_(-6, 3, generator=g)).to(dtype)
        packed, scales, s2 = quantize_nvfp4(x.cuda())
        ref_p, ref_s, _ = quantize_nvfp4(x)  # the CPU reference
        deq = dequantize_nvfp4(packed, scales, s2, dtype)
        out.append(dict(dtype=str(dtype).removeprefix("torch."), packed=sha(packed),
                        scales=sha(scales), s2=sha(s2), dequantized=sha(deq),
                        equals_reference=bool(torch.equal(packed.cpu(), ref_p)
                                              and torch.equal(scales.cpu().view(torch.uint8),
                                                              ref_s.view(torch.uint8)))))
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    key = lambda r: (r["n"], r["k"], r["m"], r["dtype"])  # noqa: E731
    bm = {key(r): r for r in b["linear"]}
    bad = 0
    for r in a["linear"]:
        s = bm.get(key(r))
        if s is None or s["sha256"] != r["sha256"] or s["weight_sha256"] != r["weight_sha256"]:
            bad += 1
            print("DIFFER", key(r), r["kernel"], s and s["kernel"])
    for r in a["linear"] + b["linear"]:
        if not (r["exact"] and r["prepared_equal"]):
            bad += 1
            print("NOT EXACT OR NOT PREPARED-EQUAL", key(r), r["kernel"], r)
    if a["stream"] != b["stream"] or not all(r["equals_reference"] for r in b["stream"]):
        bad += 1
        print("quantize/dequantize DIFFER")
    kernels = sorted({r["kernel"] for r in b["linear"]})
    print(f"{len(a['linear'])} linear cases, kernels {kernels}: "
          f"{'all bit-equal' if not bad else f'{bad} problems'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out is required unless --compare")
    t0 = time.time()
    rows, wt, key = [], None, None
    for n, k, m, dtype in cases():
        if key != (n, k, dtype):
            wt, key = None, (n, k, dtype)
            torch.cuda.empty_cache()
            wt = Weight(n, k, dtype)
        rows.append(one(wt, n, k, m, dtype))
    result = dict(gpu=torch.cuda.get_device_name(0), linear=rows, stream=stream(),
                  seconds=round(time.time() - t0, 1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    kernels: dict[str, int] = {}
    for r in rows:
        kernels[r["kernel"]] = kernels.get(r["kernel"], 0) + 1
    print(f"{len(rows)} cases by kernel {kernels}; not exact: "
          f"{[(r['n'], r['k'], r['m'], r['dtype']) for r in rows if not r['exact']]}; "
          f"prepared differs: {sum(not r['prepared_equal'] for r in rows)}; "
          f"{result['seconds']} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
