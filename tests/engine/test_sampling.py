"""Sampling: greedy, seeding by (seed, step), top-k and top-p, one row or a whole batch."""

from __future__ import annotations

import pytest
import torch

from libs.engine.sampling import (
    BatchSampling,
    SamplingParams,
    sample,
    sample_batch,
    step_keys,
    step_seed,
    token_uniforms,
)


def _logits(seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    for s in range(5):
        lg = _logits(s)
        assert sample(lg, SamplingParams(temperature=0), step=3) == int(lg.argmax())


def test_same_seed_same_tokens_and_steps_differ():
    p = SamplingParams(temperature=1.0, seed=42)
    lg = _logits()
    a = [sample(lg, p, step) for step in range(50)]
    b = [sample(lg, p, step) for step in range(50)]
    assert a == b
    assert len(set(a)) > 5  # steps draw different randomness


def test_step_seeding_is_independent_of_history():
    """Token k depends only on (seed, k, logits): a decode process reproduces step k alone."""
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    lgs = [_logits(i) for i in range(10)]
    colocated = [sample(lg, p, i) for i, lg in enumerate(lgs)]
    # "prefill" samples step 0, a fresh "decode" process samples 1..9
    split = [sample(lgs[0], p, 0)] + [sample(lgs[i], p, i) for i in range(1, 10)]
    assert colocated == split
    # seed passed by the caller when params.seed is None
    q = SamplingParams(temperature=0.8, top_p=0.9)
    assert [sample(lg, q, i, seed=7) for i, lg in enumerate(lgs)] == colocated


def test_different_seeds_differ():
    lg = torch.zeros(1000)
    a = [sample(lg, SamplingParams(seed=1), i) for i in range(20)]
    b = [sample(lg, SamplingParams(seed=2), i) for i in range(20)]
    assert a != b
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 0)


def test_tiny_top_p_is_greedy():
    for s in range(10):
        lg = _logits(s)
        p = SamplingParams(temperature=1.5, top_p=1e-6, seed=s)
        assert sample(lg, p, step=s) == int(lg.argmax())


def test_top_p_restricts_support():
    lg = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    assert {sample(lg, p, i) for i in range(200)} == {0, 1}


def test_sampling_follows_distribution():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    p = SamplingParams(temperature=1.0, seed=11)
    counts = torch.bincount(torch.tensor([sample(lg, p, i) for i in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)



# ---- the batched sampler ----------------------------------------------------------------

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's output function, in Python integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _splitmix_reference(key: int, v: int) -> float:
    """Output v of SplitMix64 seeded by key, in Python integers, as the sampler's uniform."""
    z = _mix64((key + (v + 1) * 0x9E3779B97F4A7C15) & _MASK)
    return ((z >> 11) + 0.5) * 2.0**-53


def _splitmix_state(seed: int) -> int:
    return _mix64((seed + 0x9E3779B97F4A7C15) & _MASK)


def _draw(logits, rows, device="cpu"):
    """rows: (params, seed, step) per row of logits [B, V]; the sampled ids as a list."""
    params, seeds, steps = zip(*rows, strict=True)
    batch = BatchSampling.build(params, seeds, steps, device)
    return sample_batch(logits.to(device), batch).tolist()


def test_uniforms_are_splitmix64_of_the_step_key():
    keys = [step_seed(s, n) for s, n in ((0, 0), (1, 7), (2**62 + 5, 3), (123456789, 99))]
    u = token_uniforms(torch.tensor(keys), 300)
    for b, key in enumerate(keys):
        for v in (0, 1, 2, 150, 299):
            assert u[b, v].item() == _splitmix_reference(key, v)
    assert 0 < u.min() and u.max() < 1


def test_step_keys_on_the_device_are_step_seed():
    seeds = [0, 1, 7, 2**62 + 5, 2**63 - 1, 2**64 - 1, 123456789]
    steps = [0, 1, 2, 1000, 5, 3, 2**31]
    states = []
    for s in seeds:
        state = _splitmix_state(s)
        states.append(state - (1 << 64) if state >= 1 << 63 else state)
    got = step_keys(torch.tensor(states), torch.tensor(steps)).tolist()
    assert got == [step_seed(s, n) for s, n in zip(seeds, steps, strict=True)]


def test_sample_is_a_batch_of_one():
    lg = _logits(5)
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=9)
    for step in range(20):
        assert sample(lg, p, step) == _draw(lg[None], [(p, 9, step)])[0]


MIXES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=40, top_p=0.8),
]


def _same_tokens_alone_and_in_any_batch(device: str, vocab: int) -> None:
    gen = torch.Generator().manual_seed(1)
    targets = [
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=0.8, top_p=0.9, seed=43),
        SamplingParams(temperature=1.5, top_k=20, seed=44),
        SamplingParams(temperature=0.0, seed=45),
    ]
    for step in range(12):
        row = torch.randn(vocab, generator=gen) * 3
        for p in targets:
            alone = _draw(row[None], [(p, p.seed, step)], device)[0]
            for size in (2, 7, 33):
                others = torch.randn(size - 1, vocab, generator=gen) * 3
                where = int(torch.randint(size, (), generator=gen))
                logits = torch.cat([others[:where], row[None], others[where:]])
                rows = [(MIXES[(i + step) % len(MIXES)], 1000 + i, i * 3) for i in range(size - 1)]
                rows.insert(where, (p, p.seed, step))
                assert _draw(logits, rows, device)[where] == alone, (p, step, size)


def test_same_request_same_tokens_alone_and_in_any_batch():
    """A row's token depends on its own (logits, params, seed, step), never on its batch:
    its position, the batch size, greedy or filtered neighbours."""
    _same_tokens_alone_and_in_any_batch("cpu", 1000)


def test_greedy_rows_are_exactly_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(2)) * 4
    rows = [(MIXES[i % len(MIXES)], i, 3) for i in range(6)]
    rows[0] = (SamplingParams(temperature=0, top_k=3, top_p=0.2), 0, 3)
    got = _draw(logits, rows)
    for i, (p, _, _) in enumerate(rows):
        if p.temperature == 0:
            assert got[i] == int(logits[i].argmax())


def _frequencies(logits_row, params, draws=20000):
    logits = logits_row.expand(draws, -1)
    ids = _draw(logits, [(params, params.seed, n) for n in range(draws)])
    return torch.bincount(torch.tensor(ids), minlength=logits_row.numel()).double() / draws


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)


def test_temperature_distribution():
    """softmax(log p / T) is p**(1/T) renormalized."""
    for t in (1.0, 0.5, 1.7):
        got = _frequencies(PROBS.log().float(), SamplingParams(temperature=t, seed=3))
        want = PROBS ** (1 / t) / (PROBS ** (1 / t)).sum()
        assert torch.allclose(got, want, atol=0.015), (t, got, want)


def test_top_k_distribution():
    got = _frequencies(PROBS.log().float(), SamplingParams(temperature=1.0, top_k=3, seed=4))
    want = torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3, dtype=torch.float64)])
    assert got[3:].sum() == 0
    assert torch.allclose(got, want, atol=0.015), got


def test_top_p_distribution():
    """top_p=0.75: the smallest prefix reaching 0.75 is {0.4, 0.25, 0.15} (mass 0.8)."""
    got = _frequencies(PROBS.log().float(), SamplingParams(temperature=1.0, top_p=0.75, seed=5))
    want = torch.cat([PROBS[:3] / PROBS[:3].sum(), torch.zeros(3, dtype=torch.float64)])
    assert got[3:].sum() == 0
    assert torch.allclose(got, want, atol=0.015), got


def test_top_k_then_top_p():
    """top_k=4 renormalizes to [.444, .278, .167, .111]; top_p=0.7 then keeps the first two."""
    p = SamplingParams(temperature=1.0, top_k=4, top_p=0.7, seed=6)
    got = _frequencies(PROBS.log().float(), p)
    want = torch.cat([PROBS[:2] / PROBS[:2].sum(), torch.zeros(4, dtype=torch.float64)])
    assert torch.allclose(got, want, atol=0.015), got


def test_edge_parameters():
    lg = _logits(8, vocab=300)
    steps = range(40)

    def tokens(p):
        return [sample(lg, p, n) for n in steps]

    plain = tokens(SamplingParams(temperature=0.9, seed=1))
    assert tokens(SamplingParams(temperature=0.9, top_p=1.0, top_k=0, seed=1)) == plain
    assert tokens(SamplingParams(temperature=0.9, top_k=300, seed=1)) == plain  # k >= vocab
    assert tokens(SamplingParams(temperature=0.9, top_k=10**6, seed=1)) == plain
    assert set(tokens(SamplingParams(temperature=1.9, top_k=1, seed=1))) == {int(lg.argmax())}
    greedy = SamplingParams(temperature=0, top_k=7, top_p=0.3, seed=1)
    assert set(tokens(greedy)) == {int(lg.argmax())}
    # unfiltered rows draw the same token whether or not their batch has filtered rows
    filtered = SamplingParams(temperature=1.0, top_k=2, seed=2)
    for n in steps:
        both = _draw(torch.stack([lg, lg]), [(SamplingParams(temperature=0.9), 1, n),
                                             (filtered, 2, n)])
        assert both[0] == plain[n]


def test_top_k_never_leaves_its_support():
    lg = _logits(9, vocab=2000)
    top = set(torch.topk(lg, 5).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=5, seed=10)
    assert {sample(lg, p, n) for n in range(300)} <= top


def test_params_are_validated():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_equal_cpu_and_ignore_the_batch():
    """On the GPU: the same tokens as on the CPU for the same logits, and a row's token
    independent of its batch (SmolLM2's vocabulary, batch sizes up to 33)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 49152, generator=gen) * 3
    rows = [(MIXES[i % len(MIXES)], 77 + i, i) for i in range(64)]
    assert _draw(logits, rows, "cuda") == _draw(logits, rows, "cpu")
    _same_tokens_alone_and_in_any_batch("cuda", 49152)
