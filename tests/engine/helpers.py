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
