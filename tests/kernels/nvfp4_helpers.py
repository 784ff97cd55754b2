"""Shared helpers for the NVFP4 tests."""

import pytest
import torch

from libs.kernels.nvfp4 import reference

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def block_with_anchor(values) -> torch.Tensor:
    """One 16-element fp32 block: `values`, padded with zeros, plus a 6.0 in the last slot so
    that with global_scale 1.0 the block scale is exactly 6 / (6 * 1) = 1 and y == x."""
    values = list(values)
    assert len(values) <= 15
    return torch.tensor(values + [0.0] * (15 - len(values)) + [6.0], dtype=torch.float32)


def codes_of(packed: torch.Tensor) -> list[int]:
    return reference.unpack(packed).flatten().tolist()


def cuda_module(name: str):
    """The module libs.kernels.nvfp4.<name> for a GPU-only test module, which this skips
    whole (call it at module level) where there is no CUDA, no Triton or no Gluon."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    return pytest.importorskip(f"libs.kernels.nvfp4.{name}")


def cuda_weight(n: int, k: int, dtype: torch.dtype, seed: int, random_scales: bool = False):
    """(packed, scales, s2) on CUDA for the linear kernels' tests: a quantized random weight
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


# (N, K, M, the kernel the table gives bf16 x on a 132-SM H100 or H200): each row class of
# routing.py, and each form a routed config takes (tiles, splits, x staging, shifted or
# padded last tiles, two launches)
CASES = [
    # gemv: K sliced across warps; x staged, ragged N; fewer rows a program; several
    # tokens; ragged K (Llama-2's 11008) at one token and at five
    (4096, 4096, 1, "gemv"), (1064, 8192, 1, "gemv"), (8192, 8192, 1, "gemv"),
    (300, 28672, 1, "gemv"), (4096, 4096, 5, "gemv"), (4096, 11008, 1, "gemv"),
    (4096, 11008, 5, "gemv"),
    # gemv on mid-sized layers (Llama-3.2-1B's q/k/v and o): K sliced at one token, 64-row
    # tiles with K split in four at four tokens
    (3072, 2048, 1, "gemv"), (2048, 2048, 4, "gemv"),
    # small: x in registers (16 and 32 rows a program), by TMA on one and two warpgroups,
    # a shifted last tile with ragged N, the tiny model's layers
    (576, 576, 1, "small"), (960, 576, 32, "small"), (4240, 576, 3, "small"),
    (192, 576, 40, "small"), (576, 576, 256, "small"), (3072, 576, 256, "small"),
    (200, 576, 130, "small"), (64, 64, 5, "small"), (128, 64, 300, "small"),
    # small_phased: 16 rows, 24 rows with the split decode and a shifted tile, 32 rows,
    # 32-row boxes (five phases), three phases with ragged N
    (576, 1536, 33, "small_phased"), (576, 1536, 256, "small_phased"),
    (576, 1536, 200, "small_phased"), (960, 1536, 256, "small_phased"),
    (576, 1280, 20, "small_phased"), (200, 768, 40, "small_phased"),
    # gemm: 32-token tiles, x padded under a 128-token tile, a shifted last tile, whole
    # tiles, K split in four and in two, two launches (the second padded), the small-layer
    # configs
    (4096, 4096, 17, "gemm"), (4096, 4096, 100, "gemm"), (4096, 4096, 200, "gemm"),
    (4096, 4096, 256, "gemm"), (2048, 8192, 256, "gemm"), (4096, 14336, 520, "gemm"),
    (8192, 2048, 300, "gemm"), (8192, 2048, 330, "gemm"), (576, 1536, 600, "gemm"),
    # gemm on mid-sized layers: 16-token tiles with a shifted last tile, 64-token tiles,
    # two programs an SM (the smaller x ring)
    (3072, 2048, 20, "gemm"), (3072, 2048, 128, "gemm"), (16384, 512, 17, "gemm"),
    # triton: 9-16 tokens on large layers (64- and 128-row tiles), few tokens on a small
    # layer with long K, a mid-sized layer, long_and_light, K not whole 64-wide chunks
    (4096, 4096, 12, "triton"), (2048, 8192, 9, "triton"), (576, 1536, 1, "triton"),
    (576, 1536, 32, "triton"), (1024, 4096, 12, "triton"), (960, 2560, 48, "triton"),
    (72, 1040, 3, "triton"), (100, 48, 7, "triton"),
    # dequantize (bf16; fp16 keeps the kernels: the small kernel, the GEMM, the Triton
    # kernel's 128-token tiles with the plain decode)
    (3072, 576, 512, "dequantize"), (576, 1536, 1024, "dequantize"),
    (1024, 4096, 256, "dequantize"), (2048, 2048, 300, "dequantize"),
]
