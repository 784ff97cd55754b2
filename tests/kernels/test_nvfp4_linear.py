"""Weight-only nvfp4_linear against an explicit dequantize-then-matmul."""

import pytest
import torch

from libs.kernels import dequantize_nvfp4, nvfp4_linear, quantize_nvfp4

N, K = 24, 96
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def grid_weight(seed=0):
    """A weight whose dequantized values are exact (grid values, power-of-two scales)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = grid[torch.randint(0, 8, (N, K), generator=g)]
    w[:, ::16] = 6.0
    return w * 2.0 ** torch.randint(-3, 3, (N, 1), generator=g)


@pytest.mark.parametrize("shape", [(K,), (1, K), (5, K), (2, 3, K)])
def test_exact_when_every_product_is_exact(shape):
    # Small integers times exact FP4 weights: the fp32 matmul makes no rounding at all.
    w = grid_weight()
    packed, scales, s2 = quantize_nvfp4(w, global_scale=0.125)
    assert torch.equal(dequantize_nvfp4(packed, scales, s2, torch.float32), w)
    x = torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(1)).float()
    bias = torch.arange(N, dtype=torch.float32)
    assert torch.equal(nvfp4_linear(x, packed, scales, s2), x @ w.T)
    assert torch.equal(nvfp4_linear(x, packed, scales, s2, bias), x @ w.T + bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 7])
def test_matches_dequantize_then_matmul(dtype, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(N, K, generator=g)
    packed, scales, s2 = quantize_nvfp4(w.to(dtype))
    x = torch.randn(m, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    y = nvfp4_linear(x, packed, scales, s2, bias)
    assert y.shape == (m, N) and y.dtype == dtype
    # Against the same product in fp32, from the weight as dequantized to x.dtype: the only
    # differences allowed are the dtype's roundings of the sum (a couple of ulps of the
    # magnitudes involved; x @ W.T + bias in bf16 would itself round twice).
    w_deq = dequantize_nvfp4(packed, scales, s2, dtype).float()
    exact = x.float() @ w_deq.T + bias.float()
    scale = x.float().abs() @ w_deq.abs().T + bias.float().abs()
    assert ((y.float() - exact).abs() <= 2 * EPS[dtype] * scale).all()
    if dtype is torch.float32:
        torch.testing.assert_close(y, x @ dequantize_nvfp4(packed, scales, s2, dtype).T + bias)
    # Sanity: close to the unquantized layer (4-bit weights: a few percent).
    full = x.float() @ w.T + bias.float()
    assert (y.float() - full).norm() / full.norm() < 0.15


def test_batched_rows_equal_one_at_a_time():
    packed, scales, s2 = quantize_nvfp4(torch.randn(N, K))
    x = torch.randn(2, 3, K)
    y = nvfp4_linear(x, packed, scales, s2)
    assert y.shape == (2, 3, N)
    rows = torch.stack([nvfp4_linear(r, packed, scales, s2) for r in x.reshape(6, K)])
    torch.testing.assert_close(y.reshape(6, N), rows)
