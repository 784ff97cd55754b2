"""Host-side integer math for the kernels' launchers and configs, shared by them.

`triton.cdiv` is a constexpr_function: called from host code it goes through a wrapper
that imports and unwraps every argument, a few microseconds each time, and an eager
decode step pays that on every linear (six calls per `nvfp4_linear` at one token: cProfile,
session `probes` in docs/notes/nvfp4-triton.md). Plain Python does the same division.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def shifts_last_tile(m: int, bm: int) -> bool:
    """Whether a launch moves its last token tile back to end at M (small_kernel's
    tile_row0, the GEMM's SHIFT): where M is more than a tile and not whole tiles.
    Elsewhere the kernel keeps pid_m * BM: with the move computed at run time on every
    launch, whole tiles measured 0.03-0.18 us slower (576 x 1536 at M = 128 / 256 4.88 /
    5.83 against 4.70 / 5.66; docs/notes/nvfp4-triton.md, session `long-light`); with
    this flag a compile-time choice, they tie."""
    return m > bm and m % bm != 0
