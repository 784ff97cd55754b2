"""Host-side integer math for the kernels' launchers and configs.

`triton.cdiv` is a constexpr_function: called from host code it goes through a wrapper
that imports and unwraps every argument, a few microseconds each time, and an eager
decode step pays that on every linear (six calls per `nvfp4_linear` at one token: cProfile,
session `probes` in docs/notes/nvfp4-triton.md). Plain Python does the same division.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)
