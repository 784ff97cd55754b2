"""Step functions over a paged KV cache: chunked prefill and batched decode.

No threads, no queues: a scheduler calls ``prefill`` and ``decode_step`` and owns the pages.
Both steps run the same forward over a batch ``[B, T]`` of tokens: prefill is B=1 with T tokens,
decode is B sequences with T=1. Each layer writes its new K/V into the pool, then gathers the
sequence's pages into a padded ``[B, Hkv, L, D]`` and attends under a length/causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kvpool import KvPool
from .model import Weights, apply_rope, rms_norm, rope_tables, swiglu_mlp


@dataclass
class DecodeSeq:
    pages: list[int]  # cover positions 0..pos inclusive
    pos: int  # position of `token` = number of tokens already in the cache
    token: int


class Engine:
    def __init__(self, config: ModelConfig, weights: Weights, pool: KvPool) -> None:
        if pool.device != weights.device or pool.dtype != weights.dtype:
            raise ValueError("pool and weights must share device and dtype")
        self.config = config
        self.weights = weights
        self.pool = pool
        self.device = weights.device
        self.cos, self.sin = rope_tables(config, self.device, weights.dtype)

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], pages: Sequence[int], start_pos: int = 0
    ) -> torch.Tensor:
        """KV of ``tokens`` at positions start_pos.. into ``pages``; logits [vocab] of the last.

        ``pages`` cover the sequence from position 0, so repeated calls with consecutive chunks
        attend to the KV that earlier chunks wrote and equal one call over the whole prompt.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        end = start_pos + n
        self._check_pages(pages, end)
        ps = self.pool.page_size
        dev = self.device
        pos = torch.arange(start_pos, end, device=dev)
        page_row = torch.tensor(list(pages[: self.pool.pages_for(end)]), device=dev)
        write_pages = page_row[pos // ps][None]
        # Query i (position start_pos+i) sees keys 0..start_pos+i.
        mask = torch.arange(end, device=dev)[None, :] <= pos[:, None]
        logits = self._forward(
            tokens=torch.tensor([list(tokens)], device=dev),
            positions=pos[None],
            page_table=page_row[None],
            write_pages=write_pages,
            write_offs=(pos % ps)[None],
            mask=mask[None, None],
            kv_len=end,
        )
        return logits[0]

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One token for each of B sequences in one forward; logits [B, vocab] (fp32)."""
        if not seqs:
            raise ValueError("decode_step needs at least one sequence")
        ps = self.pool.page_size
        dev = self.device
        n_pages = [self.pool.pages_for(s.pos + 1) for s in seqs]
        for s in seqs:
            self._check_pages(s.pages, s.pos + 1)
        width = max(n_pages)
        table = [list(s.pages[:k]) + [0] * (width - k) for s, k in zip(seqs, n_pages, strict=True)]
        pos_list = [s.pos for s in seqs]
        pos = torch.tensor(pos_list, device=dev)
        write_pages = torch.tensor([s.pages[s.pos // ps] for s in seqs], device=dev)
        kv_len = max(pos_list) + 1
        mask = torch.arange(kv_len, device=dev)[None, :] <= pos[:, None]  # [B, L]
        return self._forward(
            tokens=torch.tensor([[s.token] for s in seqs], device=dev),
            positions=pos[:, None],
            page_table=torch.tensor(table, device=dev),
            write_pages=write_pages[:, None],
            write_offs=(pos % ps)[:, None],
            mask=mask[:, None, None, :],
            kv_len=kv_len,
        )

    def _check_pages(self, pages: Sequence[int], num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens)
        if len(pages) < need:
            raise ValueError(f"{num_tokens} tokens need {need} pages, got {len(pages)}")
        if num_tokens > self.config.max_position:
            raise ValueError(f"position {num_tokens - 1} beyond max_position")

    def _forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        page_table: torch.Tensor,  # [B, P] pages of each sequence (padded)
        write_pages: torch.Tensor,  # [B, T] page of each new token
        write_offs: torch.Tensor,  # [B, T] slot in that page
        mask: torch.Tensor,  # [B, 1, T, kv_len] bool, True = attend
        kv_len: int,
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        b, t = tokens.shape
        h, hkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        flat_table = page_table.reshape(-1)
        n_pages = page_table.shape[1]
        cos = self.cos[positions][:, :, None, :]  # [B, T, 1, D]
        sin = self.sin[positions][:, :, None, :]
        x = w.embed[tokens]  # [B, T, dim]
        for layer, lw in enumerate(w.layers):
            qkv = F.linear(rms_norm(x, lw.attn_norm, c.norm_eps), lw.wqkv)
            q, k, v = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], -1)
            q = apply_rope(q.view(b, t, h, d), cos, sin)
            k = apply_rope(k.view(b, t, hkv, d), cos, sin)
            kv_cache = self.pool.layer_views[layer]  # [P, 2, Hkv, S, D]
            kv_cache[write_pages, :, :, write_offs] = torch.stack([k, v.view(b, t, hkv, d)], 2)
            # Gather the sequences' pages: [B, P, 2, Hkv, S, D] -> [2, B, Hkv, P*S, D].
            kv = kv_cache.index_select(0, flat_table).view(b, n_pages, 2, hkv, -1, d)
            kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, hkv, -1, d)[:, :, :, :kv_len]
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), kv[0], kv[1], attn_mask=mask, enable_gqa=True
            )
            x = x + F.linear(attn.transpose(1, 2).reshape(b, t, c.q_dim), lw.wo)
            x = x + swiglu_mlp(rms_norm(x, lw.ffn_norm, c.norm_eps), lw)
        x = rms_norm(x[:, -1], w.norm, c.norm_eps)  # only the last position's logits are used
        return F.linear(x, w.lm_head).float()
