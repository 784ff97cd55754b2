"""Custom kernels for pdmesh, each with a torch reference that the fast paths must match."""

from .nvfp4 import (
    PreparedLinear,
    dequantize_nvfp4,
    nvfp4_linear,
    prepare_nvfp4_linear,
    quantize_nvfp4,
    swizzle_scales,
    triton_available,
    unswizzle_scales,
)

__all__ = [
    "PreparedLinear",
    "dequantize_nvfp4",
    "nvfp4_linear",
    "prepare_nvfp4_linear",
    "quantize_nvfp4",
    "swizzle_scales",
    "triton_available",
    "unswizzle_scales",
]
