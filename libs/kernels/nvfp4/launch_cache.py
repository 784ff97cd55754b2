"""Launch a Triton or Gluon kernel through its CompiledKernel once Triton has compiled it
for the call's specialization: the eager engine's host time per linear.

Why: an eager decode step is host-bound, and every NVFP4 linear is one launch. Triton's
JIT launch spends about twice the compiled kernel's own launcher's host time on a call
(binding the arguments, specializing each, hashing the constexpr layouts into its cache
key). So each launch site keys its calls itself: a static key the caller already has (its
config and dtype, in place of the constexprs they determine) plus what Triton
specializes the runtime arguments on:

- a tensor: its dtype and whether its address is a multiple of 16 bytes;
- an int: whether it is 1 (Triton makes it a constant), a multiple of 16, and fits 32 bits;
- a TMA descriptor: its dtype, block shape and layout (its type); None and floats: nothing.

That key tells apart at least the calls Triton tells apart, so one compiled kernel per key
is the one Triton would pick. A new key goes through the JIT once (compiling if needed,
launching that call) and its CompiledKernel is kept for the next calls. The current
device is part of the key, as the JIT keeps a cache per device. Profilers' launch hooks
still run: the compiled kernel's runner calls them as the JIT does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

_I32 = range(-(2**31), 2**31)


def _specialization(value) -> object:
    """What Triton's specialization of one runtime argument depends on (see the module doc)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):  # before int: a bool is an int
        return bool, value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, value in _I32
    if isinstance(value, (GluonDescriptor, TensorDescriptor)):
        return value.base.dtype, tuple(value.block_shape), value.layout
    if value is None or isinstance(value, float):
        return type(value)
    raise TypeError(f"no launch-cache specialization for {type(value).__name__}")


class LaunchCache:
    """One kernel's compiled launches, by (device, static key, runtime specialization)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel  # a JITFunction (triton.jit or gluon.jit)
        self.names = kernel.arg_names
        self.entries: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, options: dict,
                 static_key: tuple | None = None) -> tuple:
        """kernel[grid](*args, **constexprs, **options). args are the runtime arguments in
        signature order (they come first in every kernel here), constexprs the rest by
        name. static_key must determine constexprs and options; without one they are the
        key themselves (plain values: Gluon layouts cost microseconds to hash). Returns
        the entry that launched, (compiled kernel, constexpr tail), for `Launch`."""
        if static_key is None:
            static_key = tuple(constexprs.values()) + tuple(options.items())
        device = driver.active.get_current_device()
        key = (device, static_key, tuple(_specialization(a) for a in args))
        entry = self.entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            tail = tuple(constexprs[name] for name in self.names[len(args):])
            entry = self.entries[key] = (compiled, tail)
            return entry
        _run(entry, grid, driver.active.get_current_stream(device), args)
        return entry

    def bind(self, grid: tuple, args: tuple, constexprs: dict, options: dict,
             static_key: tuple | None, x: object, out: object,
             make_x: Callable[[torch.Tensor], object] | None = None,
             make_out: Callable[[torch.Tensor], object] | None = None) -> Launch:
        """This call as a `Launch` whose x and out (found in args by identity) are given
        at each call; make_x and make_out, where the argument is not the tensor itself (a
        TMA descriptor), make it from the tensor given."""
        return Launch(self, grid, args, constexprs, options, static_key, x, out, make_x,
                      make_out)


class Launch:
    """One launch site's call with everything decided but x and out, for a caller that
    runs it many times on inputs of one shape (libs/kernels/nvfp4/prepared.py): the first
    call goes through the cache, compiling if need be, and later ones straight to the
    compiled kernel's launcher, with no key at all. So every x and out given must
    specialize as the first call's did (dtype, 16-byte alignment) and the current device
    must stay the one bound; the caller's own key guarantees both. The other arguments
    (weights, workspaces, counters, sizes) are the bound ones on every call."""

    def __init__(self, cache: LaunchCache, grid: tuple, args: tuple, constexprs: dict,
                 options: dict, static_key: tuple | None, x: object, out: object,
                 make_x: Callable[[torch.Tensor], object] | None = None,
                 make_out: Callable[[torch.Tensor], object] | None = None) -> None:
        self.cache, self.constexprs, self.options = cache, constexprs, options
        self.static_key = static_key
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.args = list(args)
        self.x_at = [i for i, a in enumerate(args) if a is x]
        self.out_at = [i for i, a in enumerate(args) if a is out]
        for i in self.x_at + self.out_at:  # keep no tensor of the binding call alive
            self.args[i] = None
        self.make_x, self.make_out = make_x, make_out
        self.device = driver.active.get_current_device()
        self.entry: tuple | None = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        args = self.args.copy()
        x_arg = x if self.make_x is None else self.make_x(x)
        for i in self.x_at:
            args[i] = x_arg
        out_arg = out if self.make_out is None else self.make_out(out)
        for i in self.out_at:
            args[i] = out_arg
        if self.entry is None:
            self.entry = self.cache(self.grid, tuple(args), self.constexprs, self.options,
                                    self.static_key)
        else:
            _run(self.entry, self.grid, driver.active.get_current_stream(self.device), args)


def _run(entry: tuple, grid: tuple, stream: int, args) -> None:
    """Launch a cached entry's compiled kernel as the JIT would (launch hooks included)."""
    compiled, tail = entry
    g = tuple(grid) + (1,) * (3 - len(grid))
    full = (*args, *tail)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(g, stream, *full), knobs.runtime.launch_enter_hook,
                 knobs.runtime.launch_exit_hook, *full)
