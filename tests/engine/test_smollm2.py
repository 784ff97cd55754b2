"""The real SmolLM2 GGUF: greedy tokens equal transformers' own implementation.

The reference is loaded by transformers' GGUF code (its own dequantisation and q/k un-permute),
so a wrong un-permute or RoPE convention on our side fails here.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.generate import generate
from libs.engine.kvpool import KvPool
from libs.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say what makes them prime.",
]
NEW_TOKENS = 32


@pytest.fixture
def ours(smollm2):
    return smollm2


@pytest.fixture
def reference(hf_reference):
    return hf_reference


def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    out, first_logits = [], None
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = res.logits[0, -1]
            first_logits = logits if first_logits is None else first_logits
            tok = int(logits.argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), cache=res.cache, use_cache=True)
    return out, first_logits


def test_config_from_metadata(ours):
    c = ours.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.ffn_dim, c.vocab_size, c.max_position) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.tie_embeddings and c.eos_token_ids == (2,)


def test_greedy_matches_transformers(ours, reference):
    eng = Engine(ours.config, ours.weights, KvPool(ours.config, 64, 16))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        ids = ours.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        expect, ref_logits = _hf_greedy(reference, ids, NEW_TOKENS)
        pages = eng.pool.alloc(eng.pool.pages_for(len(ids)))
        torch.testing.assert_close(eng.prefill(ids, pages), ref_logits, atol=2e-3, rtol=1e-3)
        eng.pool.free(pages)
        got = generate(eng, ids, params, chunk_size=16)
        assert got == expect, (prompt, ours.tokenizer.decode(got), ours.tokenizer.decode(expect))


def test_batched_decode_matches_colocated(ours):
    """Four chat streams decoded together give each stream's single-stream greedy tokens."""
    eng = Engine(ours.config, ours.weights, KvPool(ours.config, 64, 16))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chat = ours.tokenizer.apply_chat_template
    prompts = [chat([{"role": "user", "content": p}]) for p in PROMPTS]
    solo = [generate(eng, ids, params) for ids in prompts]
    from libs.engine.engine import DecodeSeq

    seqs = []
    for ids in prompts:
        pages = eng.pool.alloc(eng.pool.pages_for(len(ids) + 12))
        seqs.append(DecodeSeq(pages, len(ids), int(eng.prefill(ids, pages).argmax())))
    outs = [[s.token] for s in seqs]
    for _ in range(11):
        logits = eng.decode_step(seqs)
        for s, o, row in zip(seqs, outs, logits, strict=True):
            s.pos, s.token = s.pos + 1, int(row.argmax())
            o.append(s.token)
    assert outs == solo
