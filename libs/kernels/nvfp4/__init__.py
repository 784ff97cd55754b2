"""NVFP4 (E2M1 values, e4m3 block scales per 16, fp32 per-tensor scale): public API.

Every function validates its inputs here (see checks.py), then hands the work to an
implementation chosen by `_impl`: the torch reference, which is bit-exact with ModelOpt's
checkpoint export (reference.py says what is matched), or for CUDA tensors with triton
installed the Triton kernels, whose quantize/dequantize are bit-exact with the reference
and whose linear is routed to one of several kernels (routing.py). docs/nvfp4.md describes
the format, the kernels and how their numerics are checked.
"""

import contextlib
import functools
import importlib
import importlib.util
from types import ModuleType

import torch

from . import checks, reference
from .prepared import PreparedLinear
from .swizzle import swizzle_scales, unswizzle_scales

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

# The CUDA path: a module with the same quantize/dequantize/linear signatures as
# reference.py (Triton kernels; see triton_impl.py and linear.py).
_TRITON_MODULE = __name__ + ".triton_impl"


@functools.cache  # once a process: the answer cannot change, and _impl runs on every call
def triton_available() -> bool:
    """True when triton can be imported; it is optional and never imported eagerly."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_impl() -> ModuleType | None:
    """The Triton implementation module, or None where triton or the kernels are missing."""
    if triton_available() and importlib.util.find_spec(_TRITON_MODULE):
        return importlib.import_module(_TRITON_MODULE)
    return None


def _impl(t: torch.Tensor) -> ModuleType:
    """The single dispatch point: CUDA tensors go to Triton when it and the kernels exist."""
    impl = _triton_impl() if t.is_cuda else None
    return impl if impl is not None else reference


def _on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make t's GPU the current one for the call. Triton launches on the current device
    whatever its arguments' device, and the current device is per thread: a member started
    with --device cuda:1 runs its steps in worker threads whose current device is 0."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x [..., K] (bf16/fp16/fp32, K a multiple of 16) along its last dimension.

    Returns (packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16], global_scale), with
    global_scale the decode-form s2 as a 0-d fp32 tensor: amax(|x|) / 2688 over the whole
    tensor (1.0 if x is all zero), or the caller's value (also decode form) when given, so
    shards that must share one s2 (fused q/k/v, gate/up) can pass it in.

    Raises TypeError for a non-float x, ValueError for a bad K, NaN/Inf in x, or a global
    scale that is not positive and finite.
    """
    checks.check_quantize_input(x)
    if global_scale is None:
        s2 = reference.global_scale(x)
    else:
        s2 = checks.as_global_scale(global_scale, x.device)
    with _on_device_of(x):
        packed, scales = _impl(x).quantize(x, s2)
    return packed, scales, s2


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of quantize_nvfp4: [..., K] in `dtype` (computed in fp32, cast once)."""
    checks.check_quantized(packed, scales)
    checks.check_out_dtype(dtype)
    s2 = checks.as_global_scale(global_scale, packed.device)
    with _on_device_of(packed):
        return _impl(packed).dequantize(packed, scales, s2, dtype)


def nvfp4_linear(
    x: torch.Tensor,
    packed_w: torch.Tensor,
    w_scales: torch.Tensor,
    w_global: torch.Tensor | float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only NVFP4 linear: x [..., K] @ W.T (+ bias) -> [..., N] in x.dtype.

    W is [N, K] quantized along K (packed_w [N, K/2], w_scales [N, K/16] in the linear
    layout, w_global its s2). x stays in its own dtype: activations are not quantized.
    """
    checks.check_linear(x, packed_w, w_scales, bias)
    # A CUDA weight's s2 was checked when it was made (quantize_nvfp4, the checkpoint
    # loader); testing it again here would cost a host sync on every linear.
    on_gpu = isinstance(w_global, torch.Tensor) and w_global.is_cuda
    s2 = checks.as_global_scale(w_global, packed_w.device, check_value=not on_gpu)
    with _on_device_of(x):
        return _impl(x).linear(x, packed_w, w_scales, s2, bias)


def prepare_nvfp4_linear(
    packed_w: torch.Tensor,
    w_scales: torch.Tensor,
    w_global: torch.Tensor | float,
    bias: torch.Tensor | None = None,
) -> PreparedLinear:
    """nvfp4_linear bound to one weight, for calling it many times: `prepared(x)` returns
    exactly `nvfp4_linear(x, packed_w, w_scales, w_global, bias)`, with the host work per
    call (checks, route, launch arguments) done once per x shape (prepared.py). The weight
    is checked here, s2's value included: ValueError or TypeError as nvfp4_linear's."""
    return PreparedLinear(packed_w, w_scales, w_global, bias, nvfp4_linear)
