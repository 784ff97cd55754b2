"""The CUDA weight-only linear: each call routed (routing.py) and its kernel launched.

`linear` is triton_impl's linear, what `nvfp4_linear` runs on CUDA tensors; prepared.py
plans the same route and launch once per x signature.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from . import routing, triton_kernel
from .common import sm_count
from .dequantize_kernel import dequantize


@functools.cache
def kernel_module(kernel: str) -> ModuleType | None:
    """The module whose launch(x2, packed, scales, s2, bias, out, cfg) and bind(...) run a
    routed kernel ("triton" or one of routing.GLUON_KERNELS), or None for a Gluon kernel
    this Triton cannot build (no Gluon)."""
    if kernel == "triton":
        return triton_kernel
    try:
        return importlib.import_module(f".{kernel}_kernel", __package__)
    except ImportError:
        return None


@functools.cache
def gluon_kernels() -> tuple[str, ...]:
    """The Gluon kernels this Triton can build (all of them, or none without Gluon)."""
    return tuple(name for name in routing.GLUON_KERNELS if kernel_module(name) is not None)


def route(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
          out: torch.Tensor) -> tuple[str, dict]:
    """routing.route for out [M, N] = x2 [M, K] @ W.T with these tensors: (kernel, config),
    the kernel "dequantize" (config {}) or one of kernel_module's."""
    m, k = x2.shape
    gluon = gluon_kernels() if x2.is_cuda else ()
    return routing.route(m, packed.shape[0], k, x2.dtype, sm_count(x2.device),
                         routing.operands(x2, packed, scales, out), gluon)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    s2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Weight-only y = x @ W.T + bias in x.dtype; see triton_impl's docstring for numerics.

    fp32 activations take the reference's route (Triton dequantize, then torch's fp32
    matmul): the fp32 tensor cores would round x to tf32, and fp32 is not a serving dtype."""
    if x.dtype == torch.float32:
        w = dequantize(packed, scales, s2, torch.float32)
        return torch.nn.functional.linear(x, w, bias)
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = x.dim() == 2  # the engine's case: no reshapes (each costs microseconds of host)
    x2 = x if flat else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        if s2.dtype != torch.float32 or s2.device != x.device:
            s2 = s2.to(device=x.device, dtype=torch.float32)
        kernel, cfg = route(x2, packed, scales, out)
        if kernel == "dequantize":
            out = dequantize_linear(x2, packed, scales, s2, bias)
        else:
            kernel_module(kernel).launch(x2, packed, scales, s2, bias, out, cfg)
    return out if flat else out.reshape(*x.shape[:-1], n)


def dequantize_linear(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      s2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The dequantize route: reference.linear's computation, the weight dequantized to
    x2.dtype by the Triton kernel, so its numerics bit for bit."""
    return torch.nn.functional.linear(x2, dequantize(packed, scales, s2, x2.dtype), bias)
