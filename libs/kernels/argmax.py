"""Greedy decoding's argmax over a vocabulary, in two short kernels.

Why: torch's ``argmax(-1)`` reduces each row in one thread block, so one row of Llama-3's
128,256 logits takes ~27 us on an H100, longer than a decode step's attention; at batch 1
that is 2-3 % of a 1B model's token. Here each row is cut into chunks reduced in
parallel (`_chunk_kernel`, enough programs to fill the GPU), then one program a row
picks among its chunks (`_pick_kernel`): ~2 launches of a few us.

The result is torch.argmax's, bit for bit: the first index of the largest value, and a
NaN counts as larger than any number (the first NaN wins), as in torch. Both kernels
keep that order: a chunk reports its first NaN else its first maximum, and the pick
takes the first chunk with a NaN, else the largest maximum of the lowest chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nvfp4.common import sm_count

BLOCK = 2048  # logits a program reads per loop step


@triton.jit
def _scan(src, i, n, best, index, first_nan):
    """One block of logits at indices i into each lane's running (maximum, its index,
    first NaN). Lanes see increasing indices and only a strictly larger value moves a
    lane's index, so each lane keeps its first maximum."""
    x = tl.load(src + i, mask=i < n, other=float("-inf")).to(tl.float32)
    first_nan = tl.minimum(first_nan, tl.where(x != x, i, 2**31 - 1))
    better = x > best
    return tl.where(better, x, best), tl.where(better, i, index), first_nan


@triton.jit
def _chunk_kernel(x_ptr, best_ptr, index_ptr, nan_ptr, stride_row, n, chunk, n_chunks,
                  BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * chunk
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    index = tl.full([BLOCK], 2**31 - 1, tl.int32)
    first_nan = tl.full([BLOCK], 2**31 - 1, tl.int32)
    src = x_ptr + row.to(tl.int64) * stride_row
    if INTERPRETED:
        # Triton's interpreter cannot loop over a range of kernel arguments (numpy 2
        # refuses int() of its one-element scalars); the GPU would not pipeline a while
        start = 0
        while start < chunk:
            best, index, first_nan = _scan(src, lo + start + offs, n, best, index, first_nan)
            start += BLOCK
    else:
        for start in range(0, chunk, BLOCK):
            best, index, first_nan = _scan(src, lo + start + offs, n, best, index, first_nan)
    top = tl.max(best, 0)
    # the first index holding the maximum (a chunk of -inf alone: its first index)
    at = tl.min(tl.where(best == top, index, 2**31 - 1), 0)
    at = tl.where(at == 2**31 - 1, tl.minimum(lo, n - 1), at)
    slot = row * n_chunks + c
    tl.store(best_ptr + slot, top)
    tl.store(index_ptr + slot, at)
    tl.store(nan_ptr + slot, tl.min(first_nan, 0))


@triton.jit
def _pick_kernel(best_ptr, index_ptr, nan_ptr, out_ptr, n_chunks, C_PAD: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, C_PAD)
    mask = c < n_chunks
    slot = row * n_chunks + c
    best = tl.load(best_ptr + slot, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + slot, mask=mask, other=2**31 - 1)
    first_nan = tl.min(tl.load(nan_ptr + slot, mask=mask, other=2**31 - 1), 0)
    top = tl.max(best, 0)
    # chunks cover increasing indices: the lowest index among the chunks at the maximum
    at = tl.min(tl.where(mask & (best == top), index, 2**31 - 1), 0)
    at = tl.where(first_nan < 2**31 - 1, first_nan, at)
    tl.store(out_ptr + row, at.to(tl.int64))


def chunks_for(rows: int, n: int, sms: int) -> int:
    """Chunks a row is cut into: about two programs an SM over the batch, each chunk at
    least one BLOCK (and at most 1024 chunks, the pick's one tile)."""
    want = -(-2 * sms // rows)
    return max(1, min(want, -(-n // BLOCK), 1024))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D float tensor [B, V] (last dim contiguous): [B] int64, the
    same indices as torch's."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"argmax takes a [B, V] float tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, n = x.shape
    if rows == 0 or n == 0 or n >= 2**31 - 1:
        raise ValueError(f"argmax needs 1 <= V < 2^31 and a row, got {tuple(x.shape)}")
    n_chunks = chunks_for(rows, n, sm_count(x.device))
    chunk = -(-n // n_chunks)
    chunk = -(-chunk // BLOCK) * BLOCK
    n_chunks = -(-n // chunk)  # rounding the chunk up may leave fewer
    best = torch.empty(rows * n_chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows * n_chunks, dtype=torch.int32, device=x.device)
    nan = torch.empty_like(index)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _chunk_kernel[(rows, n_chunks)](x, best, index, nan, x.stride(0), n, chunk, n_chunks,
                                    BLOCK=BLOCK, INTERPRETED=not x.is_cuda, num_warps=4)
    _pick_kernel[(rows,)](best, index, nan, out, n_chunks,
                          C_PAD=triton.next_power_of_2(n_chunks), num_warps=1)
    return out
