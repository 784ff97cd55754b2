"""Bad inputs raise TypeError/ValueError with a message that names the problem."""

import pytest
import torch

from libs.kernels import (
    dequantize_nvfp4,
    nvfp4_linear,
    quantize_nvfp4,
    swizzle_scales,
    unswizzle_scales,
)

N, K = 8, 64


def weight():
    return quantize_nvfp4(torch.randn(N, K))


@pytest.mark.parametrize(
    "x, error, match",
    [
        (torch.randn(2, 24), ValueError, "multiple of 16"),
        (torch.randn(2, 0), ValueError, "multiple of 16"),
        (torch.tensor(1.0), ValueError, "at least one dimension"),
        (torch.ones(2, 32, dtype=torch.int32), TypeError, "bfloat16, float16 or float32"),
        (torch.randn(2, 32, dtype=torch.float64), TypeError, "got torch.float64"),
        ([1.0] * 16, TypeError, "must be a torch.Tensor"),
    ],
)
def test_quantize_rejects_bad_x(x, error, match):
    with pytest.raises(error, match=match):
        quantize_nvfp4(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rejects_nan_and_inf(bad, dtype):
    x = torch.randn(4, 32, dtype=dtype)
    x[2, 17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(x)


@pytest.mark.parametrize(
    "scale, error, match",
    [
        (0.0, ValueError, "positive and finite"),
        (-1.0, ValueError, "positive and finite"),
        (float("inf"), ValueError, "positive and finite"),
        (float("nan"), ValueError, "positive and finite"),
        (torch.tensor([0.1, 0.2]), ValueError, "scalar"),
        (torch.tensor(1), TypeError, "floating-point"),
        (True, TypeError, "float or tensor"),
        ("0.1", TypeError, "float or tensor"),
    ],
)
def test_bad_global_scale(scale, error, match):
    packed, scales, _ = weight()
    with pytest.raises(error, match=match):
        quantize_nvfp4(torch.randn(2, 32), global_scale=scale)
    with pytest.raises(error, match=match):
        dequantize_nvfp4(packed, scales, scale)
    with pytest.raises(error, match=match):
        nvfp4_linear(torch.randn(2, K), packed, scales, scale)


def test_dequantize_rejects_wrong_dtypes():
    packed, scales, s2 = weight()
    with pytest.raises(TypeError, match="packed must be torch.uint8"):
        dequantize_nvfp4(packed.to(torch.int16), scales, s2)
    with pytest.raises(TypeError, match="scales must be torch.float8_e4m3fn"):
        dequantize_nvfp4(packed, scales.float(), s2)
    with pytest.raises(TypeError, match="dtype must be"):
        dequantize_nvfp4(packed, scales, s2, dtype=torch.int32)


def test_dequantize_rejects_mismatched_shapes():
    packed, scales, s2 = weight()
    with pytest.raises(ValueError, match="disagree"):
        dequantize_nvfp4(packed[:, :16].contiguous(), scales, s2)  # K/2 = 16 but scales say K = 64
    with pytest.raises(ValueError, match="disagree"):
        dequantize_nvfp4(packed[:4], scales, s2)  # different row counts


def test_non_contiguous_packed_or_scales_raise():
    packed, scales, s2 = quantize_nvfp4(torch.randn(64, 64))
    with pytest.raises(ValueError, match="packed must be contiguous"):
        dequantize_nvfp4(packed[:, ::2], scales[:, ::2], s2)
    wide_scales = torch.zeros(64, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, :4]
    with pytest.raises(ValueError, match="scales must be contiguous"):
        dequantize_nvfp4(packed, wide_scales, s2)


def test_linear_rejects_bad_shapes_and_bias():
    packed, scales, s2 = weight()
    with pytest.raises(ValueError, match="x has K=32 but the weight has K=64"):
        nvfp4_linear(torch.randn(2, 32), packed, scales, s2)
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_linear(torch.randn(2, K), packed[None], scales[None], s2)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        nvfp4_linear(torch.ones(2, K, dtype=torch.int64), packed, scales, s2)
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        nvfp4_linear(torch.randn(2, K), packed, scales, s2, bias=torch.zeros(4))
    with pytest.raises(TypeError, match="bias dtype"):
        nvfp4_linear(torch.randn(2, K), packed, scales, s2, bias=torch.zeros(N).bfloat16())


def test_swizzle_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        swizzle_scales(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-byte dtype"):
        swizzle_scales(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="pads to"):
        unswizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), 129, 4)
    with pytest.raises(ValueError, match="positive"):
        unswizzle_scales(torch.zeros(128, 4, dtype=torch.uint8), 0, 4)
