"""Attention over the paged KV pool: a step's indices built once, then called per layer.

Both steps write their new K/V into the pool in place and attend to keys where the pool
holds them, through indices the engine derived on the device from one page table: no
Python lists per token, no host sync on CUDA.

`DecodeAttention`, one new token per sequence, from a page table [B, W] and lengths [B]
(int32; a sequence of length n writes position n - 1 and attends to positions 0..n-1;
length 0 is a padding row that writes nothing). On CUDA the Triton kernels of
libs/kernels/paged_attention.py read the pages in place (GQA, split-K); on CPU torch
gathers the table's pages into [B, Hkv, W * page_size, D] with one index_select a layer
and attends with grouped matmuls, which on CPU is several times faster than SDPA with a
mask. The CPU path is the reference the kernels are tested against. Shapes depend only
on B and W, so the same code runs eagerly and inside a CUDA graph.

`PrefillAttention`, chunks packed into one row of T tokens: the chunk's K/V go into their
slots with one index_copy_, the keys of every packed sequence (its earlier chunks and
this one) come back with one index_select, and SDPA attends under a block-diagonal causal
mask, never materialising T x L x H. Quadratic in the pack's length: packs stay at a few
thousand tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer0_rows(cache: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache.view(-1, head_dim)`` at layer 0 of (page, slot) pairs [...], over
    (K/V, kv head): [2, Hkv, ...]. Layer l's rows are these plus `layer_rows(cache, l)`,
    so a step builds its indices once."""
    _, n_layers, _, hkv, ps, _ = cache.shape
    kvh = torch.arange(2 * hkv, device=cache.device).view(2, hkv) * ps
    base = pages.long() * (n_layers * 2 * hkv * ps) + slots
    return kvh.view(2, hkv, *([1] * base.dim())) + base


def layer_rows(cache: torch.Tensor, layer: int) -> int:
    """The row offset of `layer` in ``cache.view(-1, head_dim)``."""
    return layer * cache.stride(1) // cache.shape[-1]


class DecodeAttention:
    """One decode step's attention: ``attn(q, k, v, layer)`` writes k/v [B, Hkv, D] and
    returns q [B, H, D]'s attention, [B, H * D]."""

    def __init__(self, cache: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                 splits: int = 1) -> None:
        """splits: key ranges per sequence on CUDA (paged_attention.num_splits)."""
        self.cache, self.table, self.lengths, self.splits = cache, table, lengths, splits
        if cache.is_cuda:
            from libs.kernels import paged_attention  # Triton: only where the GPU runs

            self._kernels = paged_attention
            return
        ps, d = cache.shape[4], cache.shape[5]
        # Store: the slot of position length - 1 of every live row, [B', 2, Hkv] rows.
        live = (lengths > 0).nonzero().flatten()
        self.live = None if live.numel() == lengths.numel() else live
        pos = lengths[live].long() - 1
        self.write_rows = layer0_rows(cache, table[live, pos // ps], pos % ps)
        self.write_rows = self.write_rows.permute(2, 0, 1).reshape(-1)
        # Attend: every slot of the table's pages, [2, B, Hkv, L], under a length mask.
        j = torch.arange(table.shape[1] * ps, device=cache.device)
        read = layer0_rows(cache, table[:, j // ps], j % ps).transpose(1, 2)
        self.read_rows = read.reshape(-1)
        # A padding row (length 0) sees key 0: finite garbage that nobody reads, not NaN.
        self.mask = j[None, :] < lengths.clamp(min=1)[:, None]  # [B, L]
        self.kv_len = j.numel()
        self.flat = cache.view(-1, d)

    @property
    def fuses_rope(self) -> bool:
        """Whether `rope_and_attend` runs (the CUDA kernels, a power-of-two head_dim)."""
        d = self.cache.shape[-1]
        return self.cache.is_cuda and d & (d - 1) == 0

    def rope_and_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        layer: int, n_heads: int) -> torch.Tensor:
        """RoPE on qkv [B, (H + 2 Hkv) * D]'s q and k, the KV write and the attention,
        [B, H * D]: `__call__` after fused_layer.rope_qk, with the same bits, in one
        kernel less (paged_attention.rope_store_kv). Only where `fuses_rope`."""
        kernels = self._kernels
        q = kernels.rope_store_kv(qkv, cos, sin, self.cache, layer, self.table,
                                  self.lengths, n_heads)
        out = kernels.paged_decode_attention(q, self.cache, layer, self.table, self.lengths,
                                             self.splits)
        return out.view(q.shape[0], -1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer: int) -> torch.Tensor:
        b, h, d = q.shape
        if self.cache.is_cuda:
            kernels = self._kernels
            kernels.store_kv(k, v, self.cache, layer, self.table, self.lengths)
            out = kernels.paged_decode_attention(q, self.cache, layer, self.table,
                                                 self.lengths, self.splits)
            return out.view(b, h * d)
        hkv = k.shape[1]
        off = layer_rows(self.cache, layer)
        new_kv = torch.stack([k, v], 1)  # [B, 2, Hkv, D]
        if self.live is not None:
            new_kv = new_kv[self.live]
        self.flat.index_copy_(0, self.write_rows + off, new_kv.reshape(-1, d))
        kv = self.flat.index_select(0, self.read_rows + off).view(2, b, hkv, self.kv_len, d)
        scores = (q.view(b, hkv, h // hkv, d) @ kv[0].transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~self.mask.view(b, 1, 1, -1), float("-inf"))
        return (scores.softmax(-1) @ kv[1]).view(b, h * d)


class PrefillAttention:
    """One prefill pack's attention: ``attn(q, k, v, layer)`` writes k/v [1, T, Hkv, D]
    into their slots and returns q [1, T, H, D]'s attention over each query's own
    sequence up to its position, [1, T, H * D]."""

    def __init__(self, cache: torch.Tensor, write_pages: torch.Tensor,
                 write_slots: torch.Tensor, key_pages: torch.Tensor, key_slots: torch.Tensor,
                 mask: torch.Tensor) -> None:
        """write_*: [T] slot of each new token; key_*: [L] slot of each key attended to;
        mask [T, L] bool, True = attend."""
        self.cache, self.flat = cache, cache.view(-1, cache.shape[-1])
        # [T, 2, Hkv] rows of the new K/V, matching torch.stack([k, v], 2)'s layout.
        self.write_rows = layer0_rows(cache, write_pages, write_slots).permute(2, 0, 1)
        self.write_rows = self.write_rows.reshape(-1)
        self.read_rows = layer0_rows(cache, key_pages, key_slots).reshape(-1)  # [2, Hkv, L]
        self.mask = mask[None, None]
        self.kv_len = key_pages.numel()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer: int) -> torch.Tensor:
        _, t, h, d = q.shape
        hkv = k.shape[2]
        off = layer_rows(self.cache, layer)
        self.flat.index_copy_(0, self.write_rows + off, torch.stack([k, v], 2).view(-1, d))
        kv = self.flat.index_select(0, self.read_rows + off).view(2, 1, hkv, self.kv_len, d)
        if self.cache.is_cuda:
            # CUDA's memory-efficient kernel takes a mask but not grouped heads; with
            # enable_gqa it would fall back to the math kernel, which materialises every
            # T x L score: give each query head its own copy of its K/V head instead.
            kv = kv.repeat_interleave(h // hkv, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kv[0], kv[1], attn_mask=self.mask, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(1, t, h * d)
