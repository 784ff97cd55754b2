"""Shared by the engine tests: an engine over a loaded model, and its greedy logits."""

from __future__ import annotations

import torch

from libs.engine.engine import DecodeSeq, Engine
from libs.engine.kvpool import KvPool


def engine_for(loaded, num_pages: int = 16) -> Engine:
    pool = KvPool(loaded.config, num_pages, 16, dtype=loaded.weights.dtype)
    return Engine(loaded.config, loaded.weights, pool)


def greedy_logits(engine: Engine, prompt: list[int], steps: int = 2) -> torch.Tensor:
    """Prefill logits then `steps` greedy decode steps' logits, [1 + steps, vocab]."""
    pages = engine.pool.alloc(engine.pool.pages_for(len(prompt) + steps))
    out = [engine.prefill(prompt, pages)]
    for i in range(steps):
        token = int(out[-1].argmax())
        out.append(engine.decode_step([DecodeSeq(pages, len(prompt) + i, token)])[0])
    engine.pool.free(pages)
    return torch.stack(out)


def dense_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of every position by a plain causal forward over the whole
    sequence, with no pages and no cache: the reference both steps' paged attention must
    match."""
    import torch.nn.functional as F

    from libs.engine.model import apply_rope, rms_norm, swiglu_mlp
    from libs.engine.nvfp4 import linear

    c, w = engine.config, engine.weights
    t, h, hkv, d = len(tokens), c.n_heads, c.n_kv_heads, c.head_dim
    cos, sin = engine.cos[:t, None, :], engine.sin[:t, None, :]  # [T, 1, D]
    x = w.embed[torch.tensor(tokens, device=engine.device)]
    for lw in w.layers:
        q, k, v = linear(rms_norm(x, lw.attn_norm, c.norm_eps), lw.wqkv).split(
            [c.q_dim, c.kv_dim, c.kv_dim], -1
        )
        q = apply_rope(q.view(t, h, d), cos, sin).transpose(0, 1)
        k = apply_rope(k.view(t, hkv, d), cos, sin).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q, k, v.view(t, hkv, d).transpose(0, 1), is_causal=True, enable_gqa=True
        )
        x = x + linear(out.transpose(0, 1).reshape(t, h * d), lw.wo)
        x = x + swiglu_mlp(rms_norm(x, lw.ffn_norm, c.norm_eps), lw)
    return F.linear(rms_norm(x, w.norm, c.norm_eps), w.lm_head).float()
