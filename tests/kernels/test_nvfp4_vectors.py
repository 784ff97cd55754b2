"""Hand-made NVFP4 vectors: rounding ties, saturation, scale clamps, zeros, packing.

Every vector runs on the CPU (the torch reference) and, where a GPU exists, on CUDA (the
Triton kernels), with the same expected bytes.
"""

import importlib.util

import pytest
import torch

from libs.kernels import dequantize_nvfp4, quantize_nvfp4

from .nvfp4_helpers import MIDPOINTS, block_with_anchor, codes_of

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
])


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> str:
    if request.param == "cuda":  # the vectors must reach the Triton kernels, not the reference
        from libs.kernels.nvfp4 import _impl, triton_impl

        assert _impl(torch.empty(1, device="cuda")) is triton_impl
    return request.param


def quantize_unit_block(values, device):
    """Quantize one anchored block with s2 = 1, so block scale 1 and y == x exactly."""
    packed, scales, s2 = quantize_nvfp4(block_with_anchor(values).to(device), global_scale=1.0)
    assert scales.float().item() == 1.0 and s2.item() == 1.0
    return codes_of(packed)[:15]


def test_every_tie_rounds_to_the_even_code(device):
    ties = list(MIDPOINTS)
    codes = quantize_unit_block(ties + [-t for t in ties], device)
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4: codes 0, 2, 2, 4, 4, 6, 6.
    expected = [0, 2, 2, 4, 4, 6, 6]
    assert codes[:7] == expected
    assert codes[7:14] == [0x8 | c for c in expected]  # -0.25 -> 0x8, a negative zero


@pytest.mark.parametrize("i, tie", list(enumerate(MIDPOINTS)))
def test_just_below_and_above_each_tie(i, tie, device):
    t = torch.tensor(tie)
    below = torch.nextafter(t, torch.tensor(0.0)).item()
    above = torch.nextafter(t, torch.tensor(100.0)).item()
    # Midpoint i sits between codes i and i+1.
    codes = quantize_unit_block([below, above, -below, -above], device)
    assert codes[:4] == [i, i + 1, 8 | i, 9 + i]


def test_grid_values_encode_to_their_codes(device):
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert quantize_unit_block(grid + [-g for g in grid[1:]], device) == list(range(8)) + list(
        range(9, 16)
    )


def test_element_saturates_at_6(device):
    # amax 6.3 -> s_b = 1.05 rounds down to e4m3 1.0, so y = 6.3 > 6 and must clamp to 6.
    x = torch.zeros(16, device=device)
    x[0], x[1] = 6.3, -6.3
    packed, scales, s2 = quantize_nvfp4(x, global_scale=1.0)
    assert scales.float().item() == 1.0
    assert codes_of(packed)[:2] == [0x7, 0xF]
    assert dequantize_nvfp4(packed, scales, s2, torch.float32)[:2].tolist() == [6.0, -6.0]


def test_block_scale_saturates_at_448_not_nan(device):
    # s_b = 6000 / 6 = 1000 > 448; torch's raw e4m3 cast would give NaN (0x7F).
    x = torch.linspace(-6000.0, 6000.0, 16, device=device)
    packed, scales, s2 = quantize_nvfp4(x, global_scale=1.0)
    assert scales.view(torch.uint8).item() == 0x7E  # 448
    assert codes_of(packed)[0] == 0xF and codes_of(packed)[-1] == 0x7  # |y| = 13.4 -> 6
    out = dequantize_nvfp4(packed, scales, s2, torch.float32)
    assert torch.isfinite(out).all() and out.abs().max().item() == 6.0 * 448


@pytest.mark.parametrize("amax", [6 * 2.0**-9, 6 * 2.0**-12, 1e-30])
def test_smallest_block_scale_clamps_to_2_pow_minus_9(amax, device):
    # Below 2^-10 the e4m3 cast alone would give a zero scale (0x00).
    x = torch.zeros(16, device=device)
    x[3] = amax
    packed, scales, _ = quantize_nvfp4(x, global_scale=1.0)
    assert scales.view(torch.uint8).item() == 0x01  # 2^-9, the smallest e4m3 subnormal


def test_all_zero_block_stores_scale_one(device):
    x = torch.zeros(2, 32, device=device)
    x[0, 16:] = torch.arange(16.0)
    packed, scales, s2 = quantize_nvfp4(x)
    assert scales.view(torch.uint8)[0, 0].item() == 0x38  # e4m3 1.0
    assert scales.view(torch.uint8)[1].tolist() == [0x38, 0x38]
    assert packed[0, :8].eq(0).all() and packed[1].eq(0).all()
    assert s2.item() == pytest.approx(15 / 2688)


def test_all_zero_tensor_has_global_scale_one(device):
    packed, scales, s2 = quantize_nvfp4(torch.zeros(3, 48, dtype=torch.bfloat16, device=device))
    assert s2.dtype == torch.float32 and s2.shape == () and s2.item() == 1.0
    assert scales.view(torch.uint8).eq(0x38).all() and packed.eq(0).all()
    assert dequantize_nvfp4(packed, scales, s2).eq(0).all()


def test_negative_zero(device):
    # Input -0.0 -> 0x0 (as ModelOpt: sign is `y < 0`); a negative value that rounds to zero
    # -> 0x8, which decodes to -0.0.
    x = block_with_anchor([-0.0, -0.1, 0.1]).to(device)
    packed, scales, s2 = quantize_nvfp4(x, global_scale=1.0)
    assert codes_of(packed)[:3] == [0x0, 0x8, 0x0]
    out = dequantize_nvfp4(packed, scales, s2, torch.float32)
    assert out[1].item() == 0.0 and torch.signbit(out[1]) and not torch.signbit(out[0])


def test_packing_puts_element_0_in_the_low_nibble(device):
    x = block_with_anchor([1.0, 6.0, -0.5, 3.0]).to(device)
    packed, _, _ = quantize_nvfp4(x, global_scale=1.0)
    assert packed[0].item() == 0x72  # 1.0 is code 2 (low), 6.0 code 7 (high)
    assert packed[1].item() == 0x59  # -0.5 is 0x9 (low), 3.0 is 0x5 (high)
    assert packed[7].item() == 0x70  # pad 0 (low), anchor 6.0 (high)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_exact_for_values_on_the_grid(dtype, device):
    # Per block: grid values times 2^e with a +-6 * 2^e anchor. With s2 = 1/8,
    # s_b = 6 * 2^e / (6/8) = 2^(e+3) is exact in e4m3, and so is every product.
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = grid[torch.randint(0, 8, (4, 6, 16), generator=g)]
    x = x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)
    x[..., 5] = 6.0
    x = (x * 2.0 ** torch.randint(-6, 5, (4, 6, 1), generator=g)).reshape(4, 96).to(dtype)
    packed, scales, s2 = quantize_nvfp4(x.to(device), global_scale=torch.tensor(0.125))
    assert torch.equal(dequantize_nvfp4(packed, scales, s2, dtype).cpu(), x)
