"""Property tests: shapes and dtypes, and the dequantization error bound, on random inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.kernels import dequantize_nvfp4, quantize_nvfp4
from libs.kernels.nvfp4 import reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def half_step(mag: torch.Tensor) -> torch.Tensor:
    """Half the gap between the E2M1 neighbours around |y| (gaps 0.5, 1, 2 by binade)."""
    return torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))


@st.composite
def inputs(draw):
    batch = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    k = 16 * draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    # Rows span several decades so blocks use small, large and clamped scales.
    decades = draw(st.floats(0, 5)) if dtype is not torch.float16 else 2.0
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, k, generator=g)
    x = x * 10 ** torch.empty(*batch, 1).uniform_(-decades, decades / 2, generator=g)
    return x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(inputs())
def test_shapes_dtypes_and_error_bound(x):
    packed, scales, s2 = quantize_nvfp4(x)
    k = x.shape[-1]
    assert packed.shape == (*x.shape[:-1], k // 2) and packed.dtype == torch.uint8
    assert scales.shape == (*x.shape[:-1], k // 16) and scales.dtype == torch.float8_e4m3fn
    assert s2.shape == () and s2.dtype == torch.float32 and s2 > 0
    out = dequantize_nvfp4(packed, scales, s2, dtype=x.dtype)
    assert out.shape == x.shape and out.dtype == x.dtype

    # Error of each element <= half a grid step at its magnitude times its block's scale,
    # plus what saturation cut off, plus the final cast to x.dtype.
    p = (scales.float() * s2).repeat_interleave(16, dim=-1)
    y = (x.float() / p).abs()
    bound = (half_step(y) + (y - 6).clamp(min=0)) * p * (1 + 2**-20)
    bound = bound + out.float().abs() * EPS[x.dtype]
    assert ((out.float() - x.float()).abs() <= bound).all()


@settings(max_examples=50, deadline=None)
@given(inputs())
def test_block_scale_is_block_amax_over_6_s2_rounded_to_e4m3(x):
    _, scales, s2 = quantize_nvfp4(x)
    amax_b = x.float().unflatten(-1, (-1, 16)).abs().amax(-1)
    raw = amax_b / (6 * s2)
    normal = (raw >= 2.0**-6) & (raw <= 448)  # e4m3 normals: 3 mantissa bits
    assert ((scales.float() - raw).abs() <= raw * 2.0**-4)[normal].all()
    assert (scales.float() == 2.0**-9)[(raw < 2.0**-10) & (amax_b > 0)].all()
    assert (scales.float() == 1.0)[amax_b == 0].all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_is_independent_of_input_dtype(dtype):
    x = torch.randn(3, 32, dtype=dtype)
    packed, scales, s2 = quantize_nvfp4(x)
    as_f32 = dequantize_nvfp4(packed, scales, s2, torch.float32)
    for out_dtype in DTYPES:
        assert torch.equal(dequantize_nvfp4(packed, scales, s2, out_dtype), as_f32.to(out_dtype))
    assert dequantize_nvfp4(packed, scales, s2).dtype == torch.bfloat16  # the default


def test_non_contiguous_input_quantizes_like_its_contiguous_copy():
    x = torch.randn(64, 48)
    view = x.T  # [48, 64], K = 64 along a strided dimension
    assert not view.is_contiguous()
    p1, s1, g1 = quantize_nvfp4(view)
    p2, s2, g2 = quantize_nvfp4(view.contiguous())
    assert torch.equal(p1, p2) and torch.equal(g1, g2)
    assert torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))


def test_given_global_scale_is_used_and_returned():
    x = torch.randn(4, 64)
    packed, scales, s2 = quantize_nvfp4(x, global_scale=0.01)
    assert s2.item() == torch.tensor(0.01).item()
    assert torch.equal(packed, reference.quantize(x, torch.tensor(0.01))[0])
    packed2, _, s2b = quantize_nvfp4(x, global_scale=torch.tensor([0.01], dtype=torch.float64))
    assert torch.equal(packed, packed2) and s2b.shape == ()


def test_empty_batch():
    packed, scales, s2 = quantize_nvfp4(torch.empty(0, 32))
    assert packed.shape == (0, 16) and scales.shape == (0, 2) and s2.item() == 1.0
    assert dequantize_nvfp4(packed, scales, s2).shape == (0, 32)
