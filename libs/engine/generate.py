"""Colocated reference generation: chunked prefill then decode steps, no KV transfer."""

from __future__ import annotations

from collections.abc import Sequence

from .engine import DecodeSeq, Engine
from .sampling import SamplingParams, request_seed, sample


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    chunk_size: int = 512,
    seed: int | None = None,
) -> list[int]:
    """Generated token ids (the stop/EOS token included when one ends the stream)."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    pool, cfg = engine.pool, engine.config
    max_tokens = min(params.max_tokens, cfg.max_position - len(prompt_ids))
    if max_tokens < 1:
        raise ValueError("prompt fills the context")
    seed = request_seed(params) if seed is None else seed
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(cfg.eos_token_ids)
    # The last sampled token is never fed back, so the cache holds prompt + max_tokens - 1.
    pages = pool.alloc(pool.pages_for(len(prompt_ids) + max_tokens - 1))
    try:
        for start in range(0, len(prompt_ids), chunk_size):
            logits = engine.prefill(prompt_ids[start : start + chunk_size], pages, start)
        out: list[int] = []
        pos = len(prompt_ids)
        while True:
            token = sample(logits, params, len(out), seed)
            out.append(token)
            if token in stop_ids or len(out) >= max_tokens:
                return out
            logits = engine.decode_step([DecodeSeq(pages, pos, token)])[0]
            pos += 1
    finally:
        pool.free(pages)
