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
