"""Engine math on small random models: chunked prefill, batched decode, HF equivalence."""

from __future__ import annotations

import time

import pytest
import torch

from libs.engine.engine import DecodeSeq, PrefillSeq
from libs.engine.generate import generate
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams

from .conftest import make_engine


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 23])
def test_chunked_prefill_equals_one_shot(chunk, page_size):
    eng = make_engine(page_size=page_size)
    prompt = _prompt(61)
    pages_a = eng.pool.alloc(eng.pool.pages_for(len(prompt)))
    one_shot = eng.prefill(prompt, pages_a)
    pages_b = eng.pool.alloc(eng.pool.pages_for(len(prompt)))
    for start in range(0, len(prompt), chunk):
        chunked = eng.prefill(prompt[start : start + chunk], pages_b, start)
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)
    n = len(prompt)
    kv_a = eng.pool.tensor[pages_a].transpose(0, 3).flatten(3, 4)[..., :n, :]
    kv_b = eng.pool.tensor[pages_b].transpose(0, 3).flatten(3, 4)[..., :n, :]
    torch.testing.assert_close(kv_a, kv_b, atol=1e-5, rtol=1e-5)


def test_prefill_logits_match_last_decode():
    """Prefill of n tokens == prefill of n-1 then one decode step of the last."""
    eng = make_engine()
    prompt = _prompt(40)
    pa = eng.pool.alloc(3)
    full = eng.prefill(prompt, pa)
    pb = eng.pool.alloc(3)
    eng.prefill(prompt[:-1], pb)
    step = eng.decode_step([DecodeSeq(pb, len(prompt) - 1, prompt[-1])])[0]
    torch.testing.assert_close(step, full, atol=1e-4, rtol=1e-4)


def test_batched_decode_equals_one_at_a_time():
    lengths = [1, 7, 16, 17, 40, 3]
    batched, single = make_engine(page_size=8), make_engine(page_size=8)
    seqs_b, seqs_s = [], []
    for i, n in enumerate(lengths):
        prompt = _prompt(n, seed=i)
        for eng, seqs in ((batched, seqs_b), (single, seqs_s)):
            pages = eng.pool.alloc(eng.pool.pages_for(n + 8))
            logits = eng.prefill(prompt, pages)
            seqs.append(DecodeSeq(pages, n, int(logits.argmax())))
    for _ in range(6):
        lb = batched.decode_step(seqs_b)
        ls = torch.stack([single.decode_step([s])[0] for s in seqs_s])
        torch.testing.assert_close(lb, ls, atol=1e-4, rtol=1e-4)
        for seqs, lg in ((seqs_b, lb), (seqs_s, ls)):
            for s, row in zip(seqs, lg, strict=True):
                s.pos, s.token = s.pos + 1, int(row.argmax())
    assert [s.token for s in seqs_b] == [s.token for s in seqs_s]


def test_prefill_batch_equals_separate_prefills():
    """Packed prefill of several sequences (fresh and continued chunks) == one at a time."""
    a, b = make_engine(page_size=8), make_engine(page_size=8)
    prompts = [_prompt(n, seed=n) for n in (5, 33, 1, 17)]
    pages = [[0, 1], [2, 3, 4, 5, 6], [7], [8, 9, 10]]
    # sequence 3 arrives as a continuation: its first 9 tokens are already in the cache
    for eng in (a, b):
        eng.prefill(prompts[3][:9], pages[3])
    starts = [0, 0, 0, 9]
    batch = a.prefill_batch(
        [PrefillSeq(p[s:], pg, s) for p, pg, s in zip(prompts, pages, starts, strict=True)]
    )
    one = torch.stack(
        [b.prefill(p[s:], pg, s) for p, pg, s in zip(prompts, pages, starts, strict=True)]
    )
    torch.testing.assert_close(batch, one, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.pool.tensor, b.pool.tensor, atol=1e-5, rtol=1e-5)


def test_non_contiguous_pages_and_isolation():
    """Scattered pages give the same result, and other sequences' pages are untouched."""
    eng = make_engine(page_size=4)
    prompt = _prompt(20)
    pages = eng.pool.alloc(5)
    ref = eng.prefill(prompt, pages)
    eng.pool.free(pages)
    scattered = [9, 2, 30, 17, 5]
    before = eng.pool.tensor.clone()
    out = eng.prefill(prompt, scattered)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    changed = (eng.pool.tensor != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(scattered)


def test_too_few_pages_rejected():
    eng = make_engine(page_size=4)
    with pytest.raises(ValueError):
        eng.prefill(_prompt(9), [0, 1])
    with pytest.raises(ValueError):
        eng.decode_step([DecodeSeq([0], 4, 1)])


def test_generate_chunking_invariant():
    eng = make_engine(page_size=8)
    prompt = _prompt(50)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    a = generate(eng, prompt, p, chunk_size=512)
    b = generate(eng, prompt, p, chunk_size=13)
    assert a == b and len(a) == 20
    assert eng.pool.used == 0
    s = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=20, ignore_eos=True)
    assert generate(eng, prompt, s, chunk_size=7) == generate(eng, prompt, s)


def test_generate_stops_on_stop_token():
    eng = make_engine()
    prompt = _prompt(10)
    free = generate(eng, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    stop_at = free[3]
    first = free.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    out = generate(eng, prompt, params)
    assert out == free[: first + 1]


def test_hf_directory_matches_transformers(tmp_path):
    """A transformers-saved Llama (untied head, odd rope theta) loads and computes identically."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    m = load_model(str(tmp_path))
    assert m.config.rope_theta == 5000.0 and not m.config.tie_embeddings
    from libs.engine.engine import Engine
    from libs.engine.kvpool import KvPool

    eng = Engine(m.config, m.weights, KvPool(m.config, 8, 16))
    prompt = _prompt(30)
    ours = eng.prefill(prompt, [0, 1])
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_tiny_end_to_end_is_fast():
    m = load_model("tiny")
    from libs.engine.engine import Engine
    from libs.engine.kvpool import KvPool

    eng = Engine(m.config, m.weights, KvPool(m.config, 32, 16))
    ids = m.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there!"}])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    elapsed = []
    threads = torch.get_num_threads()
    # One thread and best of 3: on a shared, oversubscribed CI box OpenMP's spin-waiting can
    # slow a model this small by 30x (see OMP_WAIT_POLICY in pdmesh/cli.py).
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            out = generate(eng, ids, params)
            elapsed.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    assert len(out) == 16
    assert isinstance(m.tokenizer.decode(out), str)
    assert min(elapsed) < 0.5, elapsed
    assert load_model("tiny").weights.embed.equal(m.weights.embed)  # deterministic weights


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    from libs.engine.loader import unpermute_rope_rows

    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
            w.shape
        )

    w = torch.randn(n_heads * 8, 12)
    permuted = llama_cpp_permute(w, n_heads)
    assert n_heads == 1 or not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, n_heads), w)
