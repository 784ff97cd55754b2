"""Host-side integer math for the kernels' launchers and configs, shared by them.

`triton.cdiv` is a constexpr_function: called from host code it goes through a wrapper
that imports and unwraps every argument, a few microseconds each time, and an eager
decode step would pay that on every linear. Plain Python does the same division.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def shifts_last_tile(m: int, bm: int) -> bool:
    """Whether a launch moves its last token tile back to end at M (small_form's
    tile_row0, the GEMM's SHIFT): where M is more than a tile and not whole tiles.
    Elsewhere the kernel keeps pid_m * BM: as a compile-time choice the move costs whole
    tiles nothing, where computed at run time on every launch it would."""
    return m > bm and m % bm != 0
