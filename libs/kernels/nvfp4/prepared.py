"""nvfp4_linear for one weight called over and over: the engine's linears.

Why: an eager decode step is host-bound. `nvfp4_linear` does its checks, its route and its
launch site's arguments on every call, for answers that only change with x's shape, and
on SmolLM2's layers that host work costs more than the kernel.

A `PreparedLinear` holds one weight, checked once, and a plan per x signature (shape,
strides, dtype, device, 16-byte alignment, stream): the first call with a signature checks x
as `nvfp4_linear` does (the same errors), routes and binds the kernel's launch
(launch_cache.Launch); later calls allocate the output and launch the compiled kernel
(making x's, and for the GEMM out's, TMA descriptors first where the kernel reads them by
TMA). The dequantize route's plan launches the compiled Triton dequantize and calls cuBLAS.
A GEMM call that pads x to whole token tiles, and more than MAX_TOKENS tokens, run
`nvfp4_linear` itself. The result is the same kernel on the same arguments, so
bit for bit `nvfp4_linear`'s. Prompt chunks are planned too: a prefill forward is as
host-bound as a decode step on a small model.

The weight tensors are read at every call, never copied: changing their values in place
shows in the next call, as with `nvfp4_linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import checks

MAX_TOKENS = 16384  # planned token counts: decode batches and prompt chunks
MAX_PLANS = 256  # signatures kept a weight; past that the plans start over


class PreparedLinear:
    """x -> nvfp4_linear(x, packed_w, w_scales, w_global, bias), with the per-call host
    work done once per x signature (see the module doc)."""

    def __init__(self, packed_w: torch.Tensor, w_scales: torch.Tensor,
                 w_global: torch.Tensor | float, bias: torch.Tensor | None,
                 unplanned: Callable[..., torch.Tensor]) -> None:
        """unplanned: nvfp4_linear itself (passed in: it lives in the package's
        __init__, which imports this module)."""
        checks.check_quantized(packed_w, w_scales)
        if packed_w.ndim != 2:
            raise ValueError(f"packed weight must be 2-D [N, K/2], got {tuple(packed_w.shape)}")
        self.packed, self.scales, self.bias = packed_w, w_scales, bias
        # Checked here once (a host read on a GPU), so the calls never read it back.
        self.s2 = checks.as_global_scale(w_global, packed_w.device)
        self.n, self.k = packed_w.shape[0], packed_w.shape[1] * 2
        self._unplanned_linear = unplanned
        self._plans: dict[tuple, _Plan | _DequantizePlan | None] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (isinstance(x, torch.Tensor) and x.is_cuda and self.packed.is_cuda):
            return self._unplanned(x)
        device = x.device
        if device.index != torch.cuda.current_device():
            return self._unplanned(x)  # nvfp4_linear switches devices; a plan does not
        # The raw stream handle, as Triton's launcher reads it (a Stream object costs more).
        key = (x.shape, x.stride(), x.dtype, device, x.data_ptr() % 16 == 0,
               torch._C._cuda_getCurrentRawStream(device.index))
        plan = self._plans.get(key, False)
        if plan is False:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._plan(x)
            if plan is not None:
                return plan.first(x)
        return plan(x) if plan is not None else self._unplanned(x)

    def _unplanned(self, x: torch.Tensor) -> torch.Tensor:
        return self._unplanned_linear(x, self.packed, self.scales, self.s2, self.bias)

    def _plan(self, x: torch.Tensor) -> _Plan | _DequantizePlan | None:
        """A plan for x's signature, or None where nvfp4_linear runs (raising its errors
        for a bad x)."""
        checks.check_linear(x, self.packed, self.scales, self.bias)
        if x.dtype == torch.float32 or x.numel() == 0 or self.n == 0:
            return None  # fp32 takes the dequantize route; nothing to launch
        x2 = x.reshape(-1, self.k)
        if x2.shape[0] > MAX_TOKENS or x2.stride(-1) != 1 or x2.data_ptr() != x.data_ptr():
            return None
        from . import linear  # Triton: imported at the first plan, as nvfp4_linear imports it
        from .gemm_configs import needs_pad

        out = torch.empty((*x.shape[:-1], self.n), dtype=x.dtype, device=x.device)
        out2 = out.view(-1, self.n)
        kernel, cfg = linear.route(x2, self.packed, self.scales, out2)
        if kernel == "dequantize":
            return _DequantizePlan(self, x2)
        if kernel == "gemm" and needs_pad(x2.shape[0], cfg):
            return None  # x is copied into whole token tiles first: nvfp4_linear does that
        bind = linear.kernel_module(kernel).bind
        launch = bind(x2, self.packed, self.scales, self.s2, self.bias, out2, cfg)
        return _Plan(launch, out.shape, x.dtype, out)


class _Plan:
    """One x signature's bound launch and output shape."""

    def __init__(self, launch, out_shape: torch.Size, dtype: torch.dtype,
                 first_out: torch.Tensor) -> None:
        self.launch, self.out_shape, self.dtype = launch, out_shape, dtype
        self.device = first_out.device
        self.first_out: torch.Tensor | None = first_out

    def first(self, x: torch.Tensor) -> torch.Tensor:
        """The planning call: into the output the launch was bound with."""
        out, self.first_out = self.first_out, None
        self.launch(x, out)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        self.launch(x, out)
        return out


class _DequantizePlan:
    """One x signature on the dequantize route (routing.py): the call
    linear.dequantize_linear makes, with x viewed as 2-D as there, and the Triton
    dequantize's launch bound once, so the same bits with less host work."""

    def __init__(self, weight: PreparedLinear, x2: torch.Tensor) -> None:
        from .dequantize_kernel import bind_dequantize

        self.weight, self.x2_shape = weight, x2.shape
        self.dequantize = bind_dequantize(weight.packed, weight.scales, weight.s2, x2.dtype)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        out = torch.nn.functional.linear(x.view(self.x2_shape), self.dequantize(), w.bias)
        return out.view(*x.shape[:-1], w.n)
