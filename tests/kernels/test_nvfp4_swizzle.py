"""128x4-tile scale swizzle: round trip, zero padding, and the byte-offset formula."""

import pytest
import torch

from libs.kernels import swizzle_scales, unswizzle_scales

SHAPES = [(1, 1), (128, 4), (130, 5), (300, 7), (256, 8), (64, 2)]


def random_scales(rows, cols):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    # Bytes 1..0x7E: positive, finite e4m3 values, never 0 so padding is recognisable.
    return torch.randint(1, 0x7F, (rows, cols), generator=g, dtype=torch.uint8).view(
        torch.float8_e4m3fn
    )


def offset(r, c, kp):
    return ((r // 128) * (kp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_round_trip_and_padding(rows, cols):
    scales = random_scales(rows, cols)
    swizzled = swizzle_scales(scales)
    mp, kp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert swizzled.shape == (mp, kp) and swizzled.dtype == torch.float8_e4m3fn
    assert swizzled.is_contiguous()
    back = unswizzle_scales(swizzled, rows, cols)
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))
    # Exactly the padding bytes are zero.
    assert int((swizzled.view(torch.uint8) == 0).sum()) == mp * kp - rows * cols
    # A flat copy of the bytes (as a kernel receives them) unswizzles the same way.
    flat = swizzled.flatten()
    assert torch.equal(unswizzle_scales(flat, rows, cols).view(torch.uint8), back.view(torch.uint8))


@pytest.mark.parametrize("rows, cols", SHAPES)
def test_byte_offset_formula(rows, cols):
    scales = random_scales(rows, cols).view(torch.uint8)
    kp = -(-cols // 4) * 4
    flat = swizzle_scales(scales).flatten()
    for r in range(rows):
        for c in range(cols):
            assert flat[offset(r, c, kp)] == scales[r, c], (r, c)


def test_non_contiguous_input_is_fine():
    scales = random_scales(8, 130)
    view = scales.T  # [130, 8]
    assert torch.equal(
        swizzle_scales(view).view(torch.uint8), swizzle_scales(view.contiguous()).view(torch.uint8)
    )
