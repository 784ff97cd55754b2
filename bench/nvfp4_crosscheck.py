"""Cross-check libs.kernels' NVFP4 torch reference against ModelOpt and torchao, byte for byte.

Neither library is a pdmesh dependency (ModelOpt pulls in much of the HF stack), so this
runs in a throwaway venv that has them, with the repository on PYTHONPATH:

    python3 -m venv /tmp/tao && /tmp/tao/bin/pip install torch==2.13.0 torchao \\
        nvidia-modelopt numpy requests huggingface_hub
    PYTHONPATH=. /tmp/tao/bin/python -m bench.nvfp4_crosscheck
    PYTHONPATH=. /tmp/tao/bin/python -m bench.nvfp4_crosscheck \\
        --write-golden tests/kernels/data/modelopt_nvfp4_golden.json

The second command records ModelOpt's outputs as digests; tests/kernels/test_nvfp4_golden.py
checks our kernels (CPU, and CUDA where present) against them in CI, without ModelOpt.

What is compared, on seeded inputs (normal, heavy-tailed, rows spanning 1e-6..1e3 so the
2^-9 scale clamp is hit, all-zero blocks, exact E2M1 ties) in bf16/fp16/fp32:

- ModelOpt `NVFP4QTensor.quantize(x, 16)` (the checkpoint export path), with its own s2
  and with a caller-given s2: packed bytes, scale bytes and s2 must be identical, and
  `NVFP4QTensor.dequantize` must equal ours.
- torchao `nvfp4_quantize(x, 16, per_tensor_scale=s2)`: computes the block scale as
  `(amax_b / 6) / s2` (ModelOpt: `amax_b / (6 * s2)`), clamps it to [2^-6, 448] (ModelOpt:
  [2^-9, 448]), stores 2^-6 rather than 1.0 for all-zero blocks, and multiplies x by a
  reciprocal `(1 / s2) / s_b` instead of dividing. So whole-pipeline bytes are only
  reported, not required equal. The comparable part is the element encoding: torchao's
  `f32_to_f4_unpacked` applied to our exact y = x / (s_b * s2) must give our codes, except
  that torchao keeps the sign of -0.0 (0x8) where ModelOpt and we give 0x0.

The result (torch 2.13.0+cpu, nvidia-modelopt 0.47.0, torchao 0.18.0,
exit 0):
- ModelOpt: packed bytes, scale bytes, s2 and dequantized values identical in all 42 runs
  (7 cases x 3 dtypes x own/given s2). The all-zero tensor is the one documented
  difference: ModelOpt gives s2 = 0 and NaN scales, we give s2 = 1.0 and scales 1.0.
- torchao element encoding given identical y: 0 differences in all 28 runs.
- torchao whole pipeline: block scales differ (a) where s_b < 2^-6 (its clamp floor; 569 of
  1024 blocks in the 1e-6..1e3 case) and (b) where its `(amax_b / 6) / s2` and our
  `amax_b / (6 * s2)` are one fp32 ulp apart across an e4m3 tie (447 of 65536 blocks in
  bf16 normal with a given s2, e.g. 336.00003 -> 352 vs 336.0 -> 320). In equal-scale
  blocks, elements differ only in bf16 inputs and the tie case (884 of 1048576 for bf16
  normal 256x4096), every one a one-ulp quotient-vs-reciprocal difference across an E2M1
  midpoint, one code step apart; 0 unexplained.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from libs.kernels import dequantize_nvfp4, quantize_nvfp4
from libs.kernels.nvfp4 import reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def cases(seed: int = 0):
    """(name, fp32 tensor, a caller-given s2 or None) triples; the caller casts to each dtype.

    Every case also runs with the s2 computed from the tensor itself."""
    g = torch.Generator().manual_seed(seed)
    yield "normal 1x16", torch.randn(1, 16, generator=g), None
    yield "normal 7x64", torch.randn(7, 64, generator=g), None
    yield "normal 256x4096", torch.randn(256, 4096, generator=g), None
    yield "cubed normal 128x512", torch.randn(128, 512, generator=g) ** 3, None
    span = 10 ** torch.empty(64, 1).uniform_(-6, 3, generator=g)
    yield "rows 1e-6..1e3 64x256", torch.randn(64, 256, generator=g) * span, None
    z = torch.randn(32, 128, generator=g)
    z[:, 16:48] = 0
    z[5] = 0
    yield "zero blocks 32x128", z, None
    # Exact ties: blocks of midpoints with a 6 in each, all times 2^e per row. With the given
    # s2 = 1/8 below, s_b = 6 * 2^e / (6 / 8) = 2^(e+3) and y = x / 2^e land on the midpoints.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    idx = torch.randint(0, 8, (64, 256), generator=g)
    sign = torch.randint(0, 2, (64, 256), generator=g) * 2 - 1
    ties = mids[idx] * sign * 2.0 ** torch.randint(-4, 5, (64, 1), generator=g)
    ties[:, ::16] = 6.0 * 2.0 ** torch.randint(-4, 5, (64, 1), generator=g)
    yield "ties 64x256", ties, 0.125


def runs(dtypes=DTYPES):
    """(case name, x in a dtype, None or a given s2): every case, dtype and s2 choice."""
    for name, x32, s2_given in cases():
        for dtype in dtypes:
            x = x32.to(dtype)
            for given in s2_options(x, s2_given):
                yield name, x, given


def s2_options(x: torch.Tensor, s2_given: float | None) -> tuple:
    """Own s2, and a given one: the case's, else 3/4 of x's own so some s_b clamp at 448."""
    if s2_given is None:
        s2_given = 0.75 * float(x.abs().max()) / 2688
    return None, torch.tensor(s2_given)


def check_modelopt() -> bool:
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    ok = True
    for name, x, given in runs():
        dtype = x.dtype
        packed, scales, s2 = quantize_nvfp4(x, given)
        q, mo_scales, mo_s2 = NVFP4QTensor.quantize(x.clone(), 16, None, given)
        same = (
            torch.equal(q._quantized_data, packed)
            and torch.equal(mo_scales.view(torch.uint8), scales.view(torch.uint8))
            and torch.equal(mo_s2.float().reshape(()), s2)
        )
        mo_deq = q.dequantize(
            dtype=dtype, scale=mo_scales, double_scale=mo_s2, block_sizes={-1: 16}
        )
        same_deq = torch.equal(mo_deq, dequantize_nvfp4(packed, scales, s2, dtype))
        tag = "given s2" if given is not None else "own s2"
        print(f"modelopt {name:24s} {str(dtype):15s} {tag:8s} "
              f"quantize {'SAME' if same else 'DIFF'}  dequant "
              f"{'SAME' if same_deq else 'DIFF'}")
        ok &= same and same_deq
    zeros = torch.zeros(4, 32, dtype=torch.bfloat16)
    _, mo_scales, mo_s2 = NVFP4QTensor.quantize(zeros.clone(), 16)
    _, scales, s2 = quantize_nvfp4(zeros)
    print(f"modelopt all-zero tensor: s2 {mo_s2.item()} scales {mo_scales.float().unique()} | "
          f"ours: s2 {s2.item()} scales {scales.float().unique()} (documented difference)")
    return ok


def check_torchao() -> bool:
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    ok = True
    for name, x, given in runs((torch.bfloat16, torch.float32)):  # what nvfp4_quantize accepts
        dtype = x.dtype
        packed, scales, s2 = quantize_nvfp4(x, given)

        # Element encoding given identical y: must match except torchao's -0.0 -> 0x8.
        y = x.float().unflatten(-1, (-1, 16)) / (scales.float() * s2).unsqueeze(-1)
        y = y.flatten(-2)
        neg_zero = (y == 0) & torch.signbit(y)
        theirs = f32_to_f4_unpacked(y.clamp(-6, 6))
        enc_diff = int(((reference.encode_e2m1(y) != theirs) & ~neg_zero).sum())
        ok &= enc_diff == 0

        # Whole pipeline. Zero blocks are left out of the scale count (torchao stores
        # 2^-6, we 1.0). Elements are compared only in blocks whose scale bytes agree;
        # there every difference must be explained by rounding: torchao's reciprocal
        # product x * ((1/s2)/s_b) and our quotient x / (s_b * s2) are one ulp apart
        # with an E2M1 midpoint between them (inclusive), so they round differently.
        ao_scales, ao_packed = nvfp4_quantize(x.contiguous(), 16, per_tensor_scale=s2)
        live = x.unflatten(-1, (-1, 16)).abs().amax(-1) > 0
        same_scale = ao_scales.view(torch.uint8) == scales.view(torch.uint8)
        scale_diff = int((~same_scale & live).sum())
        comparable = same_scale.repeat_interleave(16, dim=-1)
        differ = comparable & (
            reference.unpack(ao_packed.view(torch.uint8)) != reference.unpack(packed)
        )
        recip = x.float().unflatten(-1, (-1, 16)) * ((1.0 / s2) / scales.float())[..., None]
        recip = recip.flatten(-2)
        lo, hi = torch.minimum(y.abs(), recip.abs()), torch.maximum(y.abs(), recip.abs())
        straddle = ((lo[..., None] <= MIDPOINTS) & (MIDPOINTS <= hi[..., None])).any(-1)
        one_ulp = (y.view(torch.int32) - recip.view(torch.int32)).abs() == 1
        unexplained = int((differ & ~(straddle & one_ulp)).sum())
        ok &= unexplained == 0
        tag = "given s2" if given is not None else "own s2"
        print(
            f"torchao  {name:24s} {str(dtype):15s} {tag:8s} encoding(y) diffs {enc_diff}"
            f" (y=-0.0: {int(neg_zero.sum())}) | scale bytes differ {scale_diff}/"
            f"{int(live.sum())} non-zero blocks | elements differ {int(differ.sum())}/"
            f"{int(comparable.sum())} in equal-scale blocks, {unexplained} unexplained"
        )
    return ok


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (CPU, contiguous): the golden file stores only these."""
    flat = t.detach().cpu().contiguous().reshape(-1)  # a 0-d tensor cannot be viewed as bytes
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def digest_values(t: torch.Tensor) -> str:
    """digest() of dequantized values with -0.0 read as +0.0: the one documented difference
    (code 0x8 decodes to -0.0 here, to +0.0 in ModelOpt; torch.equal calls them equal)."""
    return digest(torch.where(t == 0, torch.zeros_like(t), t))


def write_golden(path: str) -> None:
    """Record ModelOpt's own outputs (not ours) for cases(), as sha256 digests, so CI
    can check byte identity with ModelOpt without installing it (tests/kernels)."""
    import importlib.metadata

    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    entries = []
    for name, x, given in runs():
        dtype = x.dtype
        q, mo_scales, mo_s2 = NVFP4QTensor.quantize(x.clone(), 16, None, given)
        mo_deq = q.dequantize(
            dtype=dtype, scale=mo_scales, double_scale=mo_s2, block_sizes={-1: 16}
        )
        entries.append({
            "case": name, "dtype": str(dtype).removeprefix("torch."),
            "given_s2": None if given is None else float(given),
            "input": digest(x), "packed": digest(q._quantized_data),
            "scales": digest(mo_scales.view(torch.uint8)),
            "s2": digest(mo_s2.float().reshape(())), "dequantized": digest_values(mo_deq),
        })
    record = {
        "source": "nvidia-modelopt NVFP4QTensor.quantize / dequantize (block 16)",
        "modelopt": importlib.metadata.version("nvidia-modelopt"),
        "torch": torch.__version__,
        "written_by": "python -m bench.nvfp4_crosscheck --write-golden PATH",
        "entries": entries,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {len(entries)} ModelOpt digests to {path}")


def main() -> None:
    if sys.argv[1:2] == ["--write-golden"]:
        write_golden(sys.argv[2])
        return
    results = {}
    for lib, check in (("modelopt", check_modelopt), ("torchao", check_torchao)):
        try:
            results[lib] = check()
        except ImportError as e:
            print(f"{lib}: not importable here ({e}); skipped")
    print("summary:", {k: "PASS" if v else "FAIL" for k, v in results.items()})
    if not all(results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
