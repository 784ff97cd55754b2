"""Shared helpers for the NVFP4 tests."""

import pytest
import torch

from libs.kernels.nvfp4 import reference

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# gemv_kernel configs shared by its GPU tests and its host-rule tests (gemv_configs)
# one token, K sliced across the warps (the picks at 2048-4096 rows: 8 slices of 16 or 32
# rows a program, 4 of 32 where K is not 8 slices of four chunks; and 4 and 2 slices of 16)
GEMV_SLICED = [
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=1, SLICES=8, num_warps=8),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, SLICES=4, num_warps=4),
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=1, SLICES=4, num_warps=4),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, SLICES=2, num_warps=2),
    dict(BN=256, BM=8, NBYTES=16, SPLIT_K=1, SLICES=8, num_warps=8),
]
# one token with x staged in shared memory: the pick's 64 rows on 4 warps, and 128 on 8
GEMV_X_SMEM = [
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=4, num_warps=4, X_SMEM=True),
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=1, num_warps=8, X_SMEM=True),
]
# K in whole chunks of 128 but not whole four-chunk groups per split: uneven splits whose
# last group is partly masked (the pick for 4096 x 11008 first)
GEMV_RAGGED = [
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=8, num_warps=8, RAGGED=True),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=3, num_warps=4, RAGGED=True),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, num_warps=4, RAGGED=True),
]


def block_with_anchor(values) -> torch.Tensor:
    """One 16-element fp32 block: `values`, padded with zeros, plus a 6.0 in the last slot so
    that with global_scale 1.0 the block scale is exactly 6 / (6 * 1) = 1 and y == x."""
    values = list(values)
    assert len(values) <= 15
    return torch.tensor(values + [0.0] * (15 - len(values)) + [6.0], dtype=torch.float32)


def codes_of(packed: torch.Tensor) -> list[int]:
    return reference.unpack(packed).flatten().tolist()


def gemm_config(bm=256, split=1, stages=4, w_stages=2, maxnreg=None, g=4, **extra) -> dict:
    """A gemm_kernel config: 64 x 64 steps, bm-token tiles, K split `split` ways."""
    return dict(BN=64, BM=bm, BK=64, G=g, STAGES=stages, W_STAGES=w_stages, SPLIT_K=split,
                maxnreg=maxnreg or (232 if bm > 128 else 128), **extra)


def gluon_kernel(name: str):
    """The Gluon module libs.kernels.nvfp4.<name> for a GPU-only test module, which this
    skips whole (call it at module level) where there is no CUDA or no Gluon."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    return pytest.importorskip(f"libs.kernels.nvfp4.{name}")


def cuda_weight(n: int, k: int, dtype: torch.dtype, seed: int, random_scales: bool = False):
    """(packed, scales, s2) on CUDA for the Gluon kernels' tests: a quantized random weight
    whose rows span three decades, or (random_scales) every byte pattern of packed and
    every finite e4m3 scale code."""
    g = torch.Generator().manual_seed(seed)
    if random_scales:
        packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        codes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
        codes[0, : min(k // 16, 0x7F)] = torch.arange(min(k // 16, 0x7F), dtype=torch.uint8)
        s2 = torch.tensor(2.0**-20)
        return packed.cuda(), codes.view(torch.float8_e4m3fn).cuda(), s2.cuda()
    from libs.kernels import quantize_nvfp4

    w = torch.randn(n, k, generator=g) * 10 ** torch.empty(n, 1).uniform_(-2, 1, generator=g)
    return quantize_nvfp4(w.to(dtype).cuda())


def count_exact_on_shapes(kernel, cfg, shapes, dtype) -> int:
    """Run Gluon module `kernel`'s launch with cfg on each (n, k, m) it fits, bias on odd m,
    outputs starting as NaN, each checked against the exact product; how many ran."""
    ran = 0
    for n, k, m in shapes:
        if not kernel.fits(m, k, cfg):
            continue
        ran += 1
        packed, scales, s2 = cuda_weight(n, k, dtype, seed=n + k)
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(dtype).cuda()
        bias = torch.randn(n, generator=g).to(dtype).cuda() if m % 2 else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        kernel.launch(x, packed, scales, s2.float(), bias, out, cfg)
        check_linear_exact(out, x, packed, scales, s2, bias, dtype)
    return ran


def repeated_launches(kernel, cfg, n: int, k: int, m: int, times: int = 3) -> list:
    """`times` outputs of Gluon module `kernel`'s launch with cfg on one bf16 weight and x
    (seeded), for the determinism tests."""
    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=4)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs = []
    for _ in range(times):
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        kernel.launch(x, packed, scales, s2, None, out, cfg)
        outs.append(out)
    return outs


def check_linear_exact(out, x, packed, scales, s2, bias, dtype) -> None:
    """out within the linear kernels' bound of the exact x @ W.T + bias: a few units of
    dtype's rounding of the magnitudes summed (as test_linear_matches_reference), and half
    the spacing of dtype's subnormals. NaN (an output never written) fails."""
    w = reference.dequantize(packed, scales, s2, torch.float32).double()
    exact = x.double() @ w.T + (bias.double() if bias is not None else 0)
    mag = x.double().abs() @ w.abs().T + (bias.double().abs() if bias is not None else 0)
    eps = 2.0**-8 if dtype is torch.bfloat16 else 2.0**-11
    # an output below dtype's smallest normal rounds to a fixed spacing, not a relative one:
    # half of it (2^-25 in fp16) on top
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2
    bound = (eps + x.shape[1] * 2.0**-22) * mag + tiny
    bad = ~((out.double() - exact).abs() <= bound)
    assert not bad.any(), (int(bad.sum()), bad.nonzero()[:5].tolist())


def offset_rows(packed: torch.Tensor, offset: int) -> torch.Tensor:
    """packed's bytes as a view into a wider buffer whose rows start `offset` bytes in:
    the same weights, at 16-byte aligned rows (0) or only 4-byte aligned ones (4)."""
    n, width = packed.shape
    buf = torch.zeros(n, width + 16, dtype=torch.uint8, device=packed.device)
    buf[:, offset:offset + width] = packed
    return buf[:, offset:offset + width]


def hinted_word_loads(kernel) -> int:
    """The L2-prefetching word loads in the one kernel compiled since the entries were
    cleared."""
    (compiled, _), = kernel._LAUNCHES.entries.values()
    return compiled.asm["ptx"].count("ld.global.L2::128B")
