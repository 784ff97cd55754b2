"""NVFP4 format constants, shared by the checks and every implementation.

A value is e2m1(code) * fp32(e4m3 block scale) * s2 (docs/nvfp4.md).
"""

BLOCK = 16  # elements per block scale, along the last (reduction) dimension
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # smallest positive float8_e4m3fn (a subnormal)
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: s2 = amax / 2688 lets the largest block use 448

# Magnitudes of the E2M1 codes 0..7; bit 3 of a code is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
