"""Triton dequantize kernel for NVFP4, bit-exact with reference.dequantize (and so with
ModelOpt): each output is the reference's IEEE fp32 value e2m1(code) * (fp32(s_b) * s2),
computed in the reference's order, then cast once to the output dtype.

It also serves the linear's dequantize route (routing.py): the weight dequantized to
x.dtype, then cuBLAS, which is reference.linear's own computation. bind_dequantize gives
prepared.py that launch without the JIT's host work.
"""

import torch
import triton
import triton.language as tl

from .grid import cdiv
from .launch_cache import LaunchCache

# Blocks of 16 elements per dequantize program: 2048 elements, 16 per thread with 4 warps.
_BLOCKS_PER_PROGRAM = 128


@triton.jit
def _decode_e2m1_scaled(byte, SHIFT: tl.constexpr, per_block):
    """One nibble of each byte (SHIFT 0: low, 4: high) -> e2m1 * per_block in fp32, with the
    reference's single rounding of that product; 0x8 -> -0.0 * per_block = -0.0.

    The code's 3 magnitude bits placed at fp32 bits 22-24 (and its sign at bit 31) ARE the
    value times 2^-126: E2M1's exponent bias is 1, and its subnormal (code 1 = 0.5) lands
    on fp32's subnormal 2^-127. Multiplying by 2^126 is exact (denormals are not flushed
    here), so the second product is the reference's e2m1 * per_block."""
    bits = ((byte << (22 - SHIFT)) & 0x01C00000) | ((byte << (28 - SHIFT)) & -0x80000000)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * per_block  # 2^126


@triton.jit
def _dequantize_kernel(
    packed_ptr,  # [n_blocks * 8] uint8
    scales_ptr,  # [n_blocks] uint8 (e4m3 bytes)
    s2_ptr,  # 0-d fp32
    out_ptr,  # [n_blocks * 16] in the output dtype
    n_blocks,
    BLOCKS: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < n_blocks
    byte_cols = tl.arange(0, 8)
    packed = tl.load(
        packed_ptr + blocks[:, None] * 8 + byte_cols[None, :], mask=in_range[:, None], other=0
    ).to(tl.int32)
    scale = tl.load(scales_ptr + blocks, mask=in_range, other=0)
    # As reference.dequantize: per_block = fp32(s_b) * s2 rounded once, then one product
    # per element, then one cast to the output dtype.
    per_block = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(s2_ptr)
    lo = _decode_e2m1_scaled(packed, 0, per_block[:, None])
    hi = _decode_e2m1_scaled(packed, 4, per_block[:, None])
    values = tl.reshape(tl.join(lo, hi), (BLOCKS, 16))
    cols = tl.arange(0, 16)
    out = values.to(out_ptr.dtype.element_ty)  # round to nearest even on the GPU
    tl.store(out_ptr + blocks[:, None] * 16 + cols[None, :], out, mask=in_range[:, None])


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed, scales, s2) -> [..., K] in `dtype`, computed in fp32 and cast once."""
    return _dequantize(packed, scales, s2, dtype, _BLOCKS_PER_PROGRAM, num_warps=4)


def bind_dequantize(packed: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor,
                    dtype: torch.dtype):
    """dequantize(packed, scales, s2, dtype) as a function of nothing, for a caller that
    dequantizes the same weight tensors over and over (the prepared linear's dequantize
    route): the compiled kernel is launched directly, without the JIT's ~20 us of host work
    a call. The tensors are read at each call, so in-place changes show."""
    assert scales.numel() and s2.dtype == torch.float32 and s2.device == packed.device
    out = _dequantized_like(packed, dtype)
    grid, args, constexprs, options = _dequantize_call(packed, scales, s2, out,
                                                       _BLOCKS_PER_PROGRAM, num_warps=4)
    # only out changes between calls: x is None, found nowhere in args
    launch = _DEQUANTIZE_LAUNCHES.bind(grid, args, constexprs, options, None, None, out)
    del out  # the launch holds none of it; each call has its own

    def run() -> torch.Tensor:
        y = _dequantized_like(packed, dtype)
        launch(None, y)
        return y

    return run


def _dequantize(packed, scales, s2, dtype, blocks: int, num_warps: int):
    out = _dequantized_like(packed, dtype)
    if scales.numel():
        s2 = s2.to(device=packed.device, dtype=torch.float32)
        grid, args, constexprs, options = _dequantize_call(packed, scales, s2, out, blocks,
                                                           num_warps)
        _dequantize_kernel[grid](*args, **constexprs, **options)
    return out


def _dequantized_like(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype,
                       device=packed.device)


def _dequantize_call(packed, scales, s2, out, blocks: int, num_warps: int) -> tuple:
    """(grid, runtime args, constexprs, options) of one dequantize launch; s2 fp32 on
    packed's device."""
    n_blocks = scales.numel()
    return ((cdiv(n_blocks, blocks),), (packed, scales.view(torch.uint8), s2, out, n_blocks),
            dict(BLOCKS=blocks), dict(num_warps=num_warps))


_DEQUANTIZE_LAUNCHES = LaunchCache(_dequantize_kernel)
