"""Prompt logits from a packed prefill, and log-probabilities from logits."""

from __future__ import annotations

import torch

from libs.engine.engine import PrefillSeq
from libs.engine.logprobs import token_logprobs

from .conftest import make_engine
from .helpers import dense_logits


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_all_logits_rows_equal_a_dense_forward_and_leave_the_others_alone():
    """A chunk asking for every row gets every position's logits (a continued chunk
    included), packed with chunks that get only their last; their rows are unchanged."""
    eng = make_engine(page_size=8)
    a, b = _prompt(21, seed=1), _prompt(9, seed=2)
    pa, pb = [0, 1, 2], [3, 4]
    eng.prefill(a[:5], pa)  # a continues from position 5
    seqs = [PrefillSeq(b, pb, 0), PrefillSeq(a[5:], pa, 5, all_logits=True)]
    assert eng.logit_rows(seqs) == [1, 16]
    rows = eng.prefill_batch(seqs)
    assert rows.shape[0] == 17
    torch.testing.assert_close(rows[1:], dense_logits(eng, a)[5:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows[0], dense_logits(eng, b)[-1], atol=1e-4, rtol=1e-4)


def test_token_logprobs_are_the_log_softmax_and_its_top_n():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4
    reference = torch.log_softmax(logits.double(), -1)
    got = token_logprobs(logits, [5, 0, 39], [0, 3, 40])
    assert [g.token for g in got] == [5, 0, 39]
    for row, (g, token) in enumerate(zip(got, [5, 0, 39], strict=True)):
        assert abs(g.logprob - reference[row, token].item()) < 1e-5
    assert got[0].top == ()
    values, ids = reference[1].topk(3)
    assert [t for t, _ in got[1].top] == ids.tolist()
    assert all(abs(v - w) < 1e-5 for (_, v), w in zip(got[1].top, values.tolist(), strict=True))
    assert len(got[2].top) == 40 and sorted(t for t, _ in got[2].top) == list(range(40))
