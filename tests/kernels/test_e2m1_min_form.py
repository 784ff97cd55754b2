"""The CUDA quantize kernel's E2M1 magnitude formula against the reference's rounding.

quantize_kernel._magnitude_bits computes the code of q >= 0 as
min(RNE(2q), RNE(q) + 2, RNE(q / 2) + 4, 7), each RNE one fp32 addition of 2^23 (+ offset)
and the minimum taken on those floats (a NaN loses). This replays exactly those fp32
operations in numpy (each sum is exact in float64, then rounded once to fp32, as the GPU's
FFMA/FADD round it) and compares with reference.encode_e2m1 on every fp32 within 256 ulps
of each E2M1 midpoint and grid point, a sweep of every 127th fp32 in [0, 16], and the
saturating and special values. (The GPU tests check the kernel itself bit for bit.)
"""

import numpy as np
import torch

from libs.kernels.nvfp4 import reference
from libs.kernels.nvfp4.format import E2M1_GRID

from .nvfp4_helpers import MIDPOINTS


def min_form(q: np.ndarray) -> np.ndarray:
    q64 = q.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        t1 = (q64 * 2.0 + 8388608.0).astype(np.float32)
        t2 = (q64 + 8388610.0).astype(np.float32)
        t3 = (q64 * 0.5 + 8388612.0).astype(np.float32)
    m = np.fmin(np.fmin(np.fmin(t1, t2), t3), np.float32(8388615.0))
    return m.view(np.int32) - 0x4B000000


def reference_codes(q: np.ndarray) -> np.ndarray:
    return reference.encode_e2m1(torch.from_numpy(q)).numpy().astype(np.int32)


def test_min_form_near_every_decision_point():
    anchors = np.array(MIDPOINTS + E2M1_GRID[1:] + (7.0, 8.0), dtype=np.float32)
    bits = anchors.view(np.int32)[:, None] + np.arange(-256, 257, dtype=np.int32)[None, :]
    q = bits.ravel().view(np.float32)
    assert np.array_equal(min_form(q), reference_codes(q))


def test_min_form_sweep_and_specials():
    q = np.arange(0, np.float32(16.0).view(np.int32) + 1, 127, dtype=np.int32).view(np.float32)
    assert np.array_equal(min_form(q), reference_codes(q))
    special = np.array([np.inf, 3.4e38, 1e30, 2.0**24, 16.5, 7.0], dtype=np.float32)
    assert (min_form(special) == 7).all()
    assert min_form(np.array([np.nan], dtype=np.float32))[0] == 7  # inf - inf saturates


def test_the_comparison_can_fail():
    # Plain truncation instead of round-to-nearest-even must differ somewhere: the
    # harness can tell a wrong formula from a right one.
    q = np.linspace(0, 8, 10001, dtype=np.float32)
    assert not np.array_equal(np.minimum(np.floor(2 * q), 7).astype(np.int32), reference_codes(q))
