"""Decode attention that reads the KV pool's pages where they are (Triton).

The pool is page-major, ``[num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]``
(libs/engine/kvpool.py): a sequence's keys are the rows of the pages its page table names,
so a kernel that follows the table reads them in place, with no gathered copy. The kernels:

- `store_kv`: the step's new K and V (one token per sequence) into their slots, the slot of
  position ``length - 1`` in page ``table[b, (length - 1) // page_size]``. A row whose
  length is 0 is padding (a CUDA graph's bucket wider than the batch) and writes nothing.
- `rope_store_kv`: what the engine's decode step runs instead: RoPE on the fused qkv row's
  q and k heads (fused_layer.rope_head, the same bits as fused_layer.rope_qk) and the
  store of the rotated k and of v, one launch where the two were two (a graphed decode
  step pays ~1.5 us a kernel, 32-64 us a token on 16-32 layers).
- `paged_decode_attention`: each sequence's query heads attend to its ``length`` keys. GQA
  without expanding KV: one program serves the G query heads of one KV head, so each key
  is read once. Split-K (flash-decoding): the keys of a sequence are cut into
  ``num_splits`` ranges worked on in parallel, each leaving a partial (max, sum, weighted
  V), so one sequence at a long context still fills the GPU. The ranges are a fraction of
  each sequence's own length, so every split has work at any length. The partials are
  combined in the same launch: the last split of a (sequence, KV head) to finish, elected
  by an atomic counter (split_counters.py), combines the group's heads, where a second
  kernel would cost a graphed step ~1.3 us a layer; with one split the kernel writes the
  output itself.

Causal by construction: the query is the sequence's last position and attends to all of
its keys. Softmax runs in fp32 (exp2, scores pre-scaled by log2 e); both products run on
the tensor cores in the cache's dtype with fp32 sums, except for fp32 caches (IEEE fp32,
never tf32) and under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), whose dot
is wrong for bf16: there the operands are widened to fp32 first.

The torch computation these kernels must match is the engine's CPU path,
libs/engine/attention.py (gather the pages, grouped matmuls in the model's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_layer import rope_head
from .nvfp4.common import sm_count
from .split_counters import tile_counters

BLOCK_N = 64  # keys per inner step
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, table_ptr, lengths_ptr, layer_offset,
    stride_kb, stride_kh, stride_vb, stride_vh, stride_tb, stride_lb,
    page_stride, kv_stride, head_stride,
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    b = tl.program_id(0)
    length = tl.load(lengths_ptr + b * stride_lb)
    if length > 0:
        pos = length - 1
        page = tl.load(table_ptr + b * stride_tb + pos // PAGE).to(tl.int64)
        base = cache_ptr + page * page_stride + layer_offset + (pos % PAGE) * D
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < HKV) & (d < D)
        k = tl.load(k_ptr + b * stride_kb + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + d, mask=mask)
        dst = base + h * head_stride + d
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + kv_stride, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_block(q, m_i, l_i, acc, base, table_row, start, hi, page_stride, kv_stride,
                  qk_scale, d, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """One block of keys [start, start + BLOCK) (those below hi) folded into the running
    max m_i, sum l_i and weighted values acc of the online softmax."""
    n = start + tl.arange(0, BLOCK)
    valid = n < hi
    page = tl.load(table_row + n // PAGE, mask=valid, other=0).to(tl.int64)
    rows = page * page_stride + (n % PAGE) * D
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(base + kv_stride + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, table_ptr, lengths_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    cnt_ptr, layer_offset, stride_qb, stride_qh, stride_tb, stride_lb, stride_ob, stride_oh,
    page_stride, kv_stride, head_stride, num_splits, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, S_PAD: tl.constexpr,
    DOT_F32: tl.constexpr, INTERPRETED: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n_heads = tl.num_programs(1) * G
    length = tl.load(lengths_ptr + b * stride_lb)
    # This split's keys: a 1/num_splits share of the sequence, in whole blocks.
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK) * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask,
                other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    base = cache_ptr + layer_offset + kvh * head_stride
    table_row = table_ptr + b * stride_tb
    if INTERPRETED:
        # Triton's interpreter cannot run a for loop over tensor bounds (numpy 2 refuses
        # int() of its one-element scalars); it runs a while loop, which the GPU would
        # not pipeline.
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, base, table_row, start, hi,
                                          page_stride, kv_stride, qk_scale, d,
                                          D, PAGE, BLOCK, DOT_F32)
            start += BLOCK
    else:
        for start in range(lo, hi, BLOCK):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, base, table_row, start, hi,
                                          page_stride, kv_stride, qk_scale, d,
                                          D, PAGE, BLOCK, DOT_F32)

    if SPLIT:
        # Publish this split's partials; the program that brings its (sequence, KV head)
        # count to num_splits combines every split's, for the group's query heads. The
        # barrier makes every thread's stores precede the (acq_rel, gpu-scope) atomic.
        part = (b * n_heads + heads) * num_splits + s  # [G_PAD]
        g_mask = g < G
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=q_mask)
        tl.debug_barrier()
        tile = b * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            for gi in tl.static_range(G):
                _combine_head(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, b,
                              kvh * G + gi, n_heads, num_splits, stride_ob, stride_oh,
                              D, D_PAD, S_PAD)
            # ready for the next launch (kernel order sequences it): relaxed, no fence
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # length 0: zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_head(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, b, h, n_heads, num_splits,
                  stride_ob, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                  S_PAD: tl.constexpr):
    """Query head h of sequence b: its splits' partials combined into the output. The
    partials were written by other programs, so they are read from L2 (.cg)."""
    row = b * n_heads + h
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < num_splits
    m = tl.load(part_m_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"),
                cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + row * num_splits + s, mask=s_mask, other=0.0,
                  cache_modifier=".cg")
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # every split empty: length 0
    w = tl.exp2(m - m_max)  # an empty split (m = -inf) weighs 0
    total = tl.sum(l_s * w, 0)
    acc = tl.load(part_acc_ptr + (row * num_splits + s)[:, None] * D_PAD + d[None, :],
                  mask=s_mask[:, None], other=0.0, cache_modifier=".cg")
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < D)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, cache_ptr, table_ptr, lengths_ptr, layer_offset,
    stride_row, stride_cs, stride_tb, stride_lb, page_stride, kv_stride, head_stride,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)  # q heads first, then the KV heads
    row = b.to(tl.int64)
    half = tl.arange(0, D // 2)
    if head < H:
        o1, o2 = rope_head(qkv_ptr + row * stride_row + head * D, row * stride_cs,
                           cos_ptr, sin_ptr, D)
        dst = q_ptr + (row * H + head) * D
        tl.store(dst + half, o1)
        tl.store(dst + D // 2 + half, o2)
    else:
        length = tl.load(lengths_ptr + b * stride_lb)
        if length > 0:
            kvh = head - H
            o1, o2 = rope_head(qkv_ptr + row * stride_row + (H + kvh) * D,
                               row * stride_cs, cos_ptr, sin_ptr, D)
            pos = length - 1
            page = tl.load(table_ptr + b * stride_tb + pos // PAGE).to(tl.int64)
            dst = (cache_ptr + page * page_stride + layer_offset + kvh * head_stride
                   + (pos % PAGE) * D)
            ty = cache_ptr.dtype.element_ty
            tl.store(dst + half, o1.to(ty))
            tl.store(dst + D // 2 + half, o2.to(ty))
            d = tl.arange(0, D)
            v = tl.load(qkv_ptr + row * stride_row + (H + HKV + kvh) * D + d)
            tl.store(dst + kv_stride + d, v.to(ty))


def _pow2(n: int, at_least: int = 1) -> int:
    return max(triton.next_power_of_2(n), at_least)


def _pool_strides(cache: torch.Tensor, layer: int) -> tuple[int, int, int, int]:
    """(layer offset, page stride, K-to-V stride, head stride) in elements, checking the
    page-major layout the kernels assume (slots of head_dim contiguous elements)."""
    if cache.dim() != 6 or not cache.is_contiguous():
        raise ValueError("cache must be the contiguous pool tensor "
                         "[num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]")
    if not 0 <= layer < cache.shape[1]:
        raise ValueError(f"layer {layer} outside the pool's {cache.shape[1]} layers")
    stride = cache.stride()
    return layer * stride[1], stride[0], stride[2], stride[3]


def _check_step(table: torch.Tensor, lengths: torch.Tensor, batch: int, device) -> None:
    if table.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise TypeError("page table and lengths must be int32")
    if table.dim() != 2 or table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"page table [B, max_pages] and lengths [B] for B={batch}, got "
                         f"{tuple(table.shape)} and {tuple(lengths.shape)}")
    if table.stride(1) != 1:
        raise ValueError("page table rows must be contiguous")
    if table.device != device or lengths.device != device:
        raise ValueError("page table, lengths and cache must share a device")


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, layer: int,
             table: torch.Tensor, lengths: torch.Tensor) -> None:
    """Write k, v [B, Hkv, D] (last dim contiguous) into the slot of position lengths-1 of
    each sequence; rows with length 0 write nothing."""
    batch, hkv, d = k.shape
    _check_step(table, lengths, batch, cache.device)
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must both be [B, Hkv, D] with contiguous rows")
    if cache.shape[3] != hkv or cache.shape[5] != d:
        raise ValueError(f"k/v heads {hkv} x {d} do not match the pool's "
                         f"{cache.shape[3]} x {cache.shape[5]}")
    layer_offset, page_stride, kv_stride, head_stride = _pool_strides(cache, layer)
    _store_kv_kernel[(batch,)](
        k, v, cache, table, lengths, layer_offset,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0), lengths.stride(0),
        page_stride, kv_stride, head_stride,
        HKV=hkv, HKV_PAD=_pow2(hkv), D=d, D_PAD=_pow2(d), PAGE=cache.shape[4],
        num_warps=1,
    )


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  cache: torch.Tensor, layer: int, table: torch.Tensor,
                  lengths: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A decode step's RoPE and KV write in one kernel: fused_layer.rope_qk on qkv
    [B, (H + 2 Hkv) * D] (cos/sin [B, D] or [B, 1, D], each row's position), then
    store_kv of the rotated k and of v, with the same bits. Returns q [B, H, D]
    (rotated, new and contiguous). head_dim must be a power of two."""
    batch = qkv.shape[0]
    _check_step(table, lengths, batch, cache.device)
    hkv, d = cache.shape[3], cache.shape[5]
    if qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [B, (H + 2 Hkv) * D] = [{batch}, "
                         f"{(n_heads + 2 * hkv) * d}] with contiguous rows, got "
                         f"{tuple(qkv.shape)}")
    if d < 2 or d & (d - 1):
        raise ValueError(f"rope_store_kv needs a power-of-two head_dim, got {d}")
    cos, sin = cos.reshape(batch, d), sin.reshape(batch, d)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same contiguous rows")
    layer_offset, page_stride, kv_stride, head_stride = _pool_strides(cache, layer)
    q = torch.empty((batch, n_heads, d), dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(batch, n_heads + hkv)](
        qkv, cos, sin, q, cache, table, lengths, layer_offset,
        qkv.stride(0), cos.stride(0), table.stride(0), lengths.stride(0),
        page_stride, kv_stride, head_stride,
        H=n_heads, HKV=hkv, D=d, PAGE=cache.shape[4], num_warps=1,
    )
    return q


def num_splits(batch: int, n_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per sequence so that batch * n_kv_heads * splits programs fill the GPU about
    twice over, and no split is shorter than two key blocks at ``max_len`` keys."""
    want = -(-2 * sm_count(device) // (batch * n_kv_heads))
    most = max(1, -(-max_len // (2 * BLOCK_N)))
    return max(1, min(want, most, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, layer: int,
                           table: torch.Tensor, lengths: torch.Tensor, splits: int,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v of each sequence over its ``lengths[b]`` keys in the pages
    ``table[b]`` names: q [B, H, D] (last dim contiguous) -> out [B, H, D] in q's dtype.

    ``splits`` is how many ranges each sequence's keys are cut into (`num_splits`); a
    CUDA graph fixes it at capture, so the caller chooses it. Allocates only the output
    (when not given) and, with splits > 1, the fp32 partials (the counters are the
    stream's, split_counters.py)."""
    batch, n_heads, d = q.shape
    _check_step(table, lengths, batch, cache.device)
    hkv = cache.shape[3]
    if n_heads % hkv or cache.shape[5] != d or q.stride(2) != 1:
        raise ValueError(f"q [B, H, D] with contiguous D and H a multiple of the pool's "
                         f"{hkv} KV heads of dim {cache.shape[5]}, got {tuple(q.shape)}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q is {q.dtype}, the cache {cache.dtype}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {splits}")
    group = n_heads // hkv
    layer_offset, page_stride, kv_stride, head_stride = _pool_strides(cache, layer)
    if out is None:
        out = torch.empty_like(q)
    d_pad = _pow2(d, 16)
    split = splits > 1
    if split:
        part_m = torch.empty(batch * n_heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch * n_heads * splits * d_pad, dtype=torch.float32,
                               device=q.device)
        counters = tile_counters(q.device, batch * hkv)
    else:
        part_m = part_l = part_acc = counters = out  # unused
    _decode_kernel[(batch, hkv, splits)](
        q, cache, table, lengths, out, part_m, part_l, part_acc, counters,
        layer_offset, q.stride(0), q.stride(1), table.stride(0), lengths.stride(0),
        out.stride(0), out.stride(1),
        page_stride, kv_stride, head_stride, splits, d**-0.5 * LOG2E,
        G=group, G_PAD=_pow2(group, 16), D=d, D_PAD=d_pad, PAGE=cache.shape[4], BLOCK=BLOCK_N,
        SPLIT=split, S_PAD=_pow2(splits), DOT_F32=q.dtype == torch.float32 or not q.is_cuda,
        INTERPRETED=not q.is_cuda, num_warps=4,
    )
    return out
