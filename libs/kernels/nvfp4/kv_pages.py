"""Triton kernels for the NVFP4 KV wire format: pool pages straight into their wire slots,
and wire slots straight back into pool pages, one launch each way.

The format is libs/transfer/kvwire.py's (every ``(page, layer, K|V)`` tensor quantized on
its own, its s2 from its own amax; a slot is ``s2 | scales | packed``), and the bytes are
the torch reference's bit for bit: the same IEEE fp32 operations in the same order
(``amax / 2688``, ``fl(6 * s2)``, ``fl(amax_b / c)``, the clamp, the e4m3 rounding to
nearest even, ``d = fp32(s_b) * s2``, the E2M1 code of ``fl(x / d)``).
tests/kernels/test_nvfp4_kv_pages.py checks it against the reference.

Why kernels of their own: the reference, run on a GPU, gathers the pages into a copy,
makes a dozen fp32 temporaries the size of the pages, and checks for NaN with a host
sync. For the last 512-token chunk of a Llama-3-8B prompt (64 MB of bf16 KV) that was
about 4 ms in the prefill's transfer tail, more than the write of the native bytes.
Here one program quantizes one tensor of one page, reading the pool by page id (no
gather): a pass for its amax, a pass to encode, both over 16-element blocks.

No inline PTX, so Triton's interpreter runs these on the CPU (the tests do), and each
division is a correctly rounded ``tl.div_rn``: a chunk's KV is tens of MB, so the
instructions a division costs do not decide the time (the weight quantizer in
quantize_kernel.py, which does avoid them, is for GB-sized tensors).

Non-finite KV cannot be encoded; the encode kernel counts such elements per tensor
instead of checking on the host before it runs, and the caller reads the count after
the device has settled (which the write that follows needs anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _on_device_of
from .format import BLOCK, GLOBAL_DIVISOR
from .quantize_kernel import _codes_divided

assert GLOBAL_DIVISOR == 2688.0  # written as a literal in encode_pages_kernel
ROWS = 64  # blocks of 16 elements per tile: [64, 16] values, 1,024 a step of a program


@triton.jit
def _round_e4m3(s):
    """fp32 s in [2^-9, 448] -> (s rounded to nearest even on the float8_e4m3fn grid, as
    fp32; its byte), in integer and exact fp32 steps (no PTX conversion, so the
    interpreter runs it).

    From 2^-6 up e4m3 is normal with 3 mantissa bits: round s's 23 to 3 at bit 20, ties
    to even; the byte is the exponent field ``e - 127 + 7`` and those 3 bits. Below, the
    subnormals are the multiples of 2^-9: ``s * 512`` is exact, and adding 2^23 rounds it
    to an integer m (ties to even), which is also the byte (m = 8 is 2^-6, byte 0x08,
    the smallest normal: the two forms meet)."""
    b = s.to(tl.int32, bitcast=True)
    rb = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # clear the low 20 bits: 0xFFF00000
    m = (s * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    normal = s >= 0.015625
    value = tl.where(normal, rb.to(tl.float32, bitcast=True), m.to(tl.float32) * 0.001953125)
    byte = tl.where(normal, (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7), m)
    return value, byte


@triton.jit
def _e4m3_value(byte):
    """float8_e4m3fn byte (a positive scale, 0x01..0x7E) -> its fp32 value, exact."""
    e = byte >> 3
    mant = byte & 7
    normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e2m1_value(code):
    """E2M1 code (0..15) -> fp32 value; 0x8 is -0.0. Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
    are twice-values m, m, 2m - 4, 4m - 16 on the stretches m < 4, < 6, >= 6."""
    m = code & 7
    twice = tl.where(m < 4, m, tl.where(m < 6, 2 * m - 4, 4 * m - 16))
    mag = twice.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _tile(pool_ptr, page_base, tensor_base, t, limit, N_BLOCKS: tl.constexpr,
          ROW_BLOCKS: tl.constexpr, PAGE: tl.constexpr, ROWS_: tl.constexpr):
    """Blocks t..t+ROWS_ of one tensor as fp32 [ROWS_, 16]; blocks past the tensor, and
    blocks of positions >= limit (the stale tail of a prompt's last page), read as 0."""
    rows = t + tl.arange(0, ROWS_)
    position = (rows // ROW_BLOCKS) % PAGE  # a block lies along head_dim of one position
    keep = (rows < N_BLOCKS) & (position < limit)
    offs = page_base + tensor_base + rows.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(pool_ptr + offs, mask=keep[:, None], other=0.0).to(tl.float32)
    return rows, keep, x


@triton.jit
def encode_pages_kernel(
    pool_ptr,  # [num_pages, L, 2, H, P, D] contiguous, fp32/fp16/bf16
    index_ptr,  # [n] int64: the pages to encode, in order
    slots_ptr,  # uint8 [num_pages, SLOT] (slot i carries page i)
    slots_f32_ptr,  # the same memory as fp32 (the s2 words)
    bad_ptr,  # int32 [n * L * 2]: non-finite elements of each tensor
    n_pages,
    last_tokens,  # positions of the last page that hold the prompt (P: all)
    N_BLOCKS: tl.constexpr,  # blocks of 16 in one tensor: H * P * D / 16
    ROW_BLOCKS: tl.constexpr,  # blocks along one position: D / 16
    PAGE: tl.constexpr,  # P, tokens a page
    TENSORS: tl.constexpr,  # L * 2
    SLOT: tl.constexpr,  # slot bytes
    SCALES_AT: tl.constexpr,  # byte offset of the scales in a slot (the s2 bytes)
    PACKED_AT: tl.constexpr,  # byte offset of the packed values
    ROWS_: tl.constexpr,
):
    """One program per (page, tensor): its amax, its s2, then its blocks' codes."""
    pid = tl.program_id(0)
    p = pid // TENSORS
    tensor = pid % TENSORS
    page = tl.load(index_ptr + p).to(tl.int64)
    page_base = page * (TENSORS * N_BLOCKS * 16)
    tensor_base = tensor.to(tl.int64) * (N_BLOCKS * 16)
    limit = tl.where(p == n_pages - 1, last_tokens, PAGE)

    amax = tl.zeros((ROWS_,), dtype=tl.float32)
    bad = tl.zeros((ROWS_,), dtype=tl.int32)
    for t in range(0, N_BLOCKS, ROWS_):
        _, _, x = _tile(pool_ptr, page_base, tensor_base, t, limit, N_BLOCKS, ROW_BLOCKS,
                        PAGE, ROWS_)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        bad += tl.sum(((x * 0.0) != 0.0).to(tl.int32), axis=1)  # inf * 0 and NaN are NaN
    tl.store(bad_ptr + pid, tl.sum(bad, axis=0))
    s2 = tl.div_rn(tl.max(amax, axis=0), 2688.0)  # GLOBAL_DIVISOR
    s2 = tl.where(s2 > 0.0, s2, 1.0)
    slot = page * SLOT
    tl.store(slots_f32_ptr + page * (SLOT // 4) + tensor, s2)

    c = 6.0 * s2  # rounded once, as the reference's E2M1_MAX * s2
    for t in range(0, N_BLOCKS, ROWS_):
        rows, keep, x = _tile(pool_ptr, page_base, tensor_base, t, limit, N_BLOCKS,
                              ROW_BLOCKS, PAGE, ROWS_)
        s_b = tl.div_rn(tl.max(tl.abs(x), axis=1), c)
        s_b = tl.where(s_b == 0.0, 1.0, s_b)  # an all-zero block stores 1.0
        s_b = tl.minimum(tl.maximum(s_b, 0.001953125), 448.0)  # [2^-9, 448]
        s_rounded, s_byte = _round_e4m3(s_b)
        codes = _codes_divided(x, (s_rounded * s2)[:, None])  # [ROWS_, 16] int32
        lo, hi = tl.split(tl.reshape(codes, (ROWS_, 8, 2)))
        in_tensor = rows < N_BLOCKS
        block = tensor.to(tl.int64) * N_BLOCKS + rows
        tl.store(slots_ptr + slot + SCALES_AT + block, s_byte.to(tl.uint8), mask=in_tensor)
        packed = slot + PACKED_AT + block[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(slots_ptr + packed, (lo | (hi << 4)).to(tl.uint8), mask=in_tensor[:, None])


@triton.jit
def decode_pages_kernel(
    slots_ptr, slots_f32_ptr, index_ptr, pool_ptr,
    N_BLOCKS: tl.constexpr, TENSORS: tl.constexpr, SLOT: tl.constexpr,
    SCALES_AT: tl.constexpr, PACKED_AT: tl.constexpr, ROWS_: tl.constexpr,
):  # fmt: skip
    """One program per (page, tensor): each block's 16 values ``e2m1 * (s_b * s2)``, cast."""
    pid = tl.program_id(0)
    tensor = pid % TENSORS
    page = tl.load(index_ptr + pid // TENSORS).to(tl.int64)
    s2 = tl.load(slots_f32_ptr + page * (SLOT // 4) + tensor)
    slot = page * SLOT
    out_base = page * (TENSORS * N_BLOCKS * 16) + tensor.to(tl.int64) * (N_BLOCKS * 16)
    for t in range(0, N_BLOCKS, ROWS_):
        rows = t + tl.arange(0, ROWS_)
        in_tensor = rows < N_BLOCKS
        block = tensor.to(tl.int64) * N_BLOCKS + rows
        s_byte = tl.load(slots_ptr + slot + SCALES_AT + block, mask=in_tensor, other=0x38)
        d = _e4m3_value(s_byte.to(tl.int32)) * s2  # rounded once, as the reference
        packed = slot + PACKED_AT + block[:, None] * 8 + tl.arange(0, 8)[None, :]
        byte = tl.load(slots_ptr + packed, mask=in_tensor[:, None], other=0).to(tl.int32)
        codes = tl.reshape(tl.join(byte & 15, byte >> 4), (ROWS_, 16))
        values = _e2m1_value(codes) * d[:, None]
        offs = out_base + rows.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :]
        tl.store(pool_ptr + offs, values.to(pool_ptr.dtype.element_ty),
                 mask=in_tensor[:, None])


def _shape(pool: torch.Tensor, slots: torch.Tensor) -> dict[str, int]:
    """The constexprs both kernels share, from the pool and slot shapes."""
    layers, two, heads, page, head_dim = pool.shape[1:]
    tensors = layers * two
    n_blocks = heads * page * head_dim // BLOCK
    slot = slots.shape[1]
    scales_at = tensors * 4
    return {"N_BLOCKS": n_blocks, "TENSORS": tensors, "SLOT": slot, "SCALES_AT": scales_at,
            "PACKED_AT": scales_at + tensors * n_blocks, "ROWS_": ROWS}


def _check(pool: torch.Tensor, index: torch.Tensor, slots: torch.Tensor) -> None:
    if not (pool.is_contiguous() and slots.is_contiguous()):
        raise ValueError("pool and slots must be contiguous")
    if slots.dtype != torch.uint8 or slots.shape[1] % 16 or slots.shape[0] != pool.shape[0]:
        raise ValueError(f"slots must be uint8 [{pool.shape[0]}, multiple of 16], got "
                         f"{slots.dtype} {tuple(slots.shape)}")
    if pool.shape[-1] % BLOCK:
        raise ValueError(f"head_dim {pool.shape[-1]} is not a multiple of {BLOCK}")
    if index.dtype != torch.int64 or index.ndim != 1:
        raise ValueError("index must be int64 [n]")


def encode_pages(pool: torch.Tensor, index: torch.Tensor, slots: torch.Tensor,
                 last_page_tokens: int | None = None) -> torch.Tensor:
    """Encode pool pages ``index`` into slots of the same ids. Queued on the current
    stream, no host sync: returns int32 [n * L * 2], each tensor's count of non-finite
    elements (the caller checks it once the device has run this)."""
    _check(pool, index, slots)
    page_size = pool.shape[4]
    shape = _shape(pool, slots)
    bad = torch.empty(index.numel() * shape["TENSORS"], dtype=torch.int32, device=pool.device)
    if index.numel():
        with _on_device_of(pool):  # Triton launches on the thread's current device
            encode_pages_kernel[(bad.numel(),)](
                pool, index, slots, slots.view(torch.float32), bad, index.numel(),
                page_size if last_page_tokens is None else last_page_tokens,
                ROW_BLOCKS=pool.shape[5] // BLOCK, PAGE=page_size, **shape,
            )
    return bad


def decode_pages(slots: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> None:
    """Decode slots ``index`` into the pool pages of the same ids, in the pool's dtype."""
    _check(pool, index, slots)
    shape = _shape(pool, slots)
    if index.numel():
        with _on_device_of(pool):
            decode_pages_kernel[(index.numel() * shape["TENSORS"],)](
                slots, slots.view(torch.float32), index, pool, **shape
            )
