"""Step functions over a paged KV cache: chunked prefill and batched decode.

No threads, no queues: a scheduler calls ``prefill`` and ``decode_step`` and owns the pages.
Both steps run the same forward over a batch ``[B, T]`` of tokens: prefill packs its chunks into
B=1 with T tokens, decode is B sequences with T=1. Each layer writes its new K/V into the pool
with one index_copy_, gathers every attended key position with one index_select into
``[B, Hkv, L, D]``, and attends under a causal / same-sequence / length mask. Index math is done
once per step: a layer's rows are layer 0's plus a constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kvpool import KvPool
from .model import Weights, apply_rope, rms_norm, rope_tables, swiglu_mlp
from .nvfp4 import linear


class ForwardCancelled(Exception):
    """A forward pass stopped early because its caller no longer wants it."""


@dataclass
class DecodeSeq:
    pages: list[int]  # cover positions 0..pos inclusive
    pos: int  # position of `token` = number of tokens already in the cache
    token: int


@dataclass
class PrefillSeq:
    tokens: Sequence[int]  # this chunk's tokens, at positions start_pos..
    pages: Sequence[int]  # cover positions 0..start_pos + len(tokens) - 1
    start_pos: int = 0


class Engine:
    def __init__(self, config: ModelConfig, weights: Weights, pool: KvPool) -> None:
        if pool.device != weights.device or pool.dtype != weights.dtype:
            raise ValueError("pool and weights must share device and dtype")
        self.config = config
        self.weights = weights
        self.pool = pool
        self.device = weights.device
        self.cos, self.sin = rope_tables(config, self.device, weights.dtype)

    def prefill(
        self, tokens: Sequence[int], pages: Sequence[int], start_pos: int = 0
    ) -> torch.Tensor:
        """KV of ``tokens`` at positions start_pos.. into ``pages``; logits [vocab] of the last.

        ``pages`` cover the sequence from position 0, so repeated calls with consecutive chunks
        attend to the KV that earlier chunks wrote and equal one call over the whole prompt.
        """
        return self.prefill_batch([PrefillSeq(tokens, pages, start_pos)])[0]

    @torch.inference_mode()
    def prefill_batch(
        self, seqs: Sequence[PrefillSeq], should_stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Prefill several sequences (or chunks) in one forward; logits [N, vocab] of each last.

        The chunks are packed into one row of tokens with a block-diagonal causal mask, so the
        weights stream through the cores once for the whole batch. Attention over the pack is
        quadratic in its total length: keep a pack to a few thousand tokens.
        """
        if not seqs:
            raise ValueError("prefill_batch needs at least one sequence")
        ps, dev = self.pool.page_size, self.device
        q_pos, k_pos, q_owner, k_owner, rows, last = [], [], [], [], [], []
        n_total = 0
        for i, s in enumerate(seqs):
            n = len(s.tokens)
            if n == 0:
                raise ValueError("prefill needs at least one token")
            end = s.start_pos + n
            self._check_pages(s.pages, end)
            page_row = torch.tensor(list(s.pages[: self.pool.pages_for(end)]), device=dev)
            q_pos.append(torch.arange(s.start_pos, end, device=dev))
            k_pos.append(torch.arange(end, device=dev))
            q_owner.append(torch.full((n,), i, device=dev))
            k_owner.append(torch.full((end,), i, device=dev))
            rows.append(page_row)
            n_total += n
            last.append(n_total - 1)
        qp, kp = torch.cat(q_pos), torch.cat(k_pos)
        # A query sees the keys of its own sequence at positions <= its own.
        same_seq = torch.cat(q_owner)[:, None] == torch.cat(k_owner)[None, :]
        mask = same_seq & (kp[None, :] <= qp[:, None])
        key_pages = torch.cat([r[k // ps] for r, k in zip(rows, k_pos, strict=True)])
        write_pages = torch.cat([r[q // ps] for r, q in zip(rows, q_pos, strict=True)])
        tokens = torch.tensor([t for s in seqs for t in s.tokens], device=dev)
        return self._forward(
            tokens=tokens[None],
            positions=qp[None],
            write_pages=write_pages[None],
            write_offs=(qp % ps)[None],
            key_pages=key_pages[None],
            key_offs=(kp % ps)[None],
            mask=mask[None, None],
            out_index=torch.tensor(last, device=dev),
            should_stop=should_stop,
        )

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One token for each of B sequences in one forward; logits [B, vocab] (fp32)."""
        if not seqs:
            raise ValueError("decode_step needs at least one sequence")
        ps, dev = self.pool.page_size, self.device
        n_pages = [self.pool.pages_for(s.pos + 1) for s in seqs]
        for s in seqs:
            self._check_pages(s.pages, s.pos + 1)
        width = max(n_pages)
        table = [list(s.pages[:k]) + [0] * (width - k) for s, k in zip(seqs, n_pages, strict=True)]
        pos_list = [s.pos for s in seqs]
        pos = torch.tensor(pos_list, device=dev)
        write_pages = torch.tensor([s.pages[s.pos // ps] for s in seqs], device=dev)
        j = torch.arange(max(pos_list) + 1, device=dev)  # key positions, padded to the longest
        mask = j[None, :] <= pos[:, None]  # [B, L]
        return self._forward(
            tokens=torch.tensor([[s.token] for s in seqs], device=dev),
            positions=pos[:, None],
            write_pages=write_pages[:, None],
            write_offs=(pos % ps)[:, None],
            key_pages=torch.tensor(table, device=dev)[:, j // ps],  # pad slots hit page 0: masked
            key_offs=(j % ps)[None].expand(len(seqs), -1),
            mask=mask[:, None, None, :],
        )

    def _check_pages(self, pages: Sequence[int], num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens)
        if len(pages) < need:
            raise ValueError(f"{num_tokens} tokens need {need} pages, got {len(pages)}")
        if num_tokens > self.config.max_position:
            raise ValueError(f"position {num_tokens - 1} beyond max_position")

    def _rows(self, pages: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Layer-0 row indices into ``pool.tensor.view(-1, head_dim)`` of (page, slot) pairs.

        pages/offs: [...]; result: [2, Hkv, ...] over (K/V, kv head). A later layer's rows are
        these plus ``layer * 2 * Hkv * page_size``, so a step builds its indices once.
        """
        c, ps = self.config, self.pool.page_size
        kvh = torch.arange(2 * c.n_kv_heads, device=self.device).view(2, c.n_kv_heads) * ps
        base = pages * (c.n_layers * 2 * c.n_kv_heads * ps) + offs
        return kvh.view(2, c.n_kv_heads, *([1] * base.dim())) + base

    def _forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        write_pages: torch.Tensor,  # [B, T] page of each new token
        write_offs: torch.Tensor,  # [B, T] slot in that page
        key_pages: torch.Tensor,  # [B, L] page of each key position attended to
        key_offs: torch.Tensor,  # [B, L] slot in that page
        mask: torch.Tensor,  # [B, 1, T, L] bool, True = attend
        out_index: torch.Tensor | None = None,  # B == 1: token indices whose logits to return
        should_stop: Callable[[], bool] | None = None,  # checked between layers
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        b, t = tokens.shape
        h, hkv, d, ps = c.n_heads, c.n_kv_heads, c.head_dim, self.pool.page_size
        kv_len = key_pages.shape[1]
        # The cache as rows of head_dim: writes and reads are one index_copy_/index_select each.
        cache = self.pool.tensor.view(-1, d)
        layer_stride = 2 * hkv * ps
        # [B, T, 2, Hkv] rows for the new K/V, matching torch.stack([k, v], 2)'s layout.
        write_rows = self._rows(write_pages, write_offs).permute(2, 3, 0, 1).reshape(-1)
        # [2, B, Hkv, L] rows of every key position, straight into the attention layout.
        read_rows = self._rows(key_pages, key_offs).transpose(1, 2).reshape(-1)
        cos = self.cos[positions][:, :, None, :]  # [B, T, 1, D]
        sin = self.sin[positions][:, :, None, :]
        x = w.embed[tokens]  # [B, T, dim]
        for layer, lw in enumerate(w.layers):
            if should_stop is not None and should_stop():
                # Every request of this pass is gone: stop at a layer boundary rather than
                # finish a forward nobody will read (the KV written so far is garbage).
                raise ForwardCancelled(f"stopped before layer {layer}")
            qkv = linear(rms_norm(x, lw.attn_norm, c.norm_eps), lw.wqkv)
            q, k, v = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], -1)
            q = apply_rope(q.view(b, t, h, d), cos, sin)
            k = apply_rope(k.view(b, t, hkv, d), cos, sin)
            off = layer * layer_stride
            new_kv = torch.stack([k, v.view(b, t, hkv, d)], 2).view(-1, d)
            cache.index_copy_(0, write_rows + off, new_kv)
            kv = cache.index_select(0, read_rows + off).view(2, b, hkv, kv_len, d)
            x = x + linear(_attend(q, kv[0], kv[1], mask), lw.wo)
            if should_stop is not None and should_stop():  # and halfway: a long pack's
                raise ForwardCancelled(f"stopped in layer {layer}")  # layer is ~40 ms on CPU
            x = x + swiglu_mlp(rms_norm(x, lw.ffn_norm, c.norm_eps), lw)
        x = x[0, out_index] if out_index is not None else x[:, -1]  # only these logits are used
        x = rms_norm(x, w.norm, c.norm_eps)
        return F.linear(x, w.lm_head).float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, Hkv, L, D], mask [B, 1, T, L] -> [B, T, H * D].

    One query per sequence (decode) uses grouped matmuls: on CPU that is several times faster
    than SDPA with a boolean mask. Prefill chunks use SDPA, which never materialises T x L x H.
    """
    b, t, h, d = q.shape
    hkv = k.shape[1]
    if t == 1:
        scores = (q.view(b, hkv, h // hkv, d) @ k.transpose(-1, -2)) * d**-0.5
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        return (scores.softmax(-1) @ v).view(b, 1, h * d)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, t, h * d)
