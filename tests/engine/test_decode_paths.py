"""The decode paths on CPU: the static-shape forward that CUDA graphs replay equals the
eager step, both steps equal a dense causal forward, and bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch

from libs.engine.engine import PAGES, DecodeSeq, Engine, PrefillSeq, feed_tokens
from libs.engine.graphs import DecodeGraphs, GraphOutOfMemory, _out_of_memory, buckets_for
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights

from .conftest import make_engine, small_config
from .helpers import dense_logits


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(eng: Engine, lengths: list[int], room: int = 8) -> list[DecodeSeq]:
    seqs = []
    for i, n in enumerate(lengths):
        pages = eng.pool.alloc(eng.pool.pages_for(n + room))
        logits = eng.prefill(_prompt(n, seed=i), pages)
        seqs.append(DecodeSeq(pages, n, int(logits.argmax())))
    return seqs


def _static(eng: Engine, max_batch: int) -> DecodeGraphs:
    """What the engine's CUDA graphs replay, run uncaptured on CPU."""
    width = PAGES + eng.pool.pages_for(eng.max_context)
    return DecodeGraphs(lambda rows: eng.decode_forward(rows, eng.max_context), "cpu", width,
                        max_batch, feed=feed_tokens)


def _advance(seqs: list[DecodeSeq], logits: torch.Tensor) -> None:
    for s, row in zip(seqs, logits, strict=True):
        s.pos, s.token = s.pos + 1, int(row.argmax())


@pytest.mark.parametrize("path", ["eager", "static"])
def test_a_step_fed_from_the_device_equals_one_fed_from_the_host(path):
    """Tokens named by their row in the previous step's sampled ids (-(j + 1)), as an
    overlapped decode launches them, give the logits of the same tokens given as ids,
    and ids outside the fed rows are refused."""
    lengths = [3, 9, 17]
    by_id, by_row = make_engine(page_size=8), make_engine(page_size=8)
    seqs_i, seqs_r = _prefilled(by_id, lengths), _prefilled(by_row, lengths)

    def step(eng, seqs, fed=None):
        if path == "eager":
            return eng.decode_step(seqs, fed=fed)
        graphs = static[eng]
        return graphs.run(eng._pack_decode(seqs, 0 if fed is None else fed.numel()), fed)

    static = {eng: _static(eng, 4) for eng in (by_id, by_row)}
    fed = None
    for _ in range(4):
        li, lr = step(by_id, seqs_i), step(by_row, seqs_r, fed)
        torch.testing.assert_close(lr, li, rtol=0, atol=0)
        _advance(seqs_i, li)
        fed = lr.argmax(-1)[[2, 0, 1]]  # rows in another order than the sequences
        for s, row in zip(seqs_r, (1, 2, 0), strict=True):
            s.pos, s.token = s.pos + 1, -(row + 1)
    seqs_r[0].token = -4  # a fourth row of three fed
    with pytest.raises(ValueError, match="vocabulary"):
        by_row.decode_step(seqs_r, fed=fed)


@pytest.mark.parametrize("max_batch", [8, 2])  # one padded bucket; several replays a step
def test_static_forward_equals_eager_decode(max_batch):
    """Ragged lengths in a bucket wider than the batch: the same logits, and the padding
    rows wrote nothing (the pools stay equal)."""
    lengths = [1, 7, 16, 17, 40]
    eager, graphed = make_engine(page_size=8), make_engine(page_size=8)
    seqs_e, seqs_g = _prefilled(eager, lengths), _prefilled(graphed, lengths)
    static = _static(graphed, max_batch)
    for _ in range(5):
        le = eager.decode_step(seqs_e)
        lg = static.run(graphed._pack_decode(seqs_g))
        torch.testing.assert_close(lg, le, atol=1e-4, rtol=1e-4)
        _advance(seqs_e, le)
        _advance(seqs_g, lg)
    assert [s.token for s in seqs_e] == [s.token for s in seqs_g]
    torch.testing.assert_close(graphed.pool.tensor, eager.pool.tensor, atol=1e-5, rtol=1e-5)


def test_paged_steps_equal_a_dense_forward():
    """Chunked and packed prefill, then batched decode, against a plain causal forward
    over each whole sequence: every logit the steps return is that position's."""
    eng = make_engine(page_size=5)
    a, b = _prompt(30, seed=1), _prompt(9, seed=2)
    pa, pb = eng.pool.alloc(eng.pool.pages_for(37)), eng.pool.alloc(eng.pool.pages_for(16))
    first = eng.prefill(a[:13], pa)
    packed = eng.prefill_batch([PrefillSeq(a[13:], pa, 13), PrefillSeq(b, pb, 0)])
    got = {"a": [first, packed[0]], "b": [packed[1]]}
    seqs = [DecodeSeq(pa, 30, 5), DecodeSeq(pb, 9, 7)]
    tokens = {"a": list(a), "b": list(b)}
    for _ in range(6):
        logits = eng.decode_step(seqs)
        for name, s, row in zip("ab", seqs, logits, strict=True):
            tokens[name].append(s.token)
            got[name].append(row)
        _advance(seqs, logits)
    ref_a, ref_b = dense_logits(eng, tokens["a"]), dense_logits(eng, tokens["b"])
    want_a = torch.stack([ref_a[12], ref_a[29], *ref_a[30:36]])
    torch.testing.assert_close(torch.stack(got["a"]), want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.stack(got["b"]), ref_b[8:15], atol=1e-4, rtol=1e-4)


def test_decode_step_copy_false_is_the_same_logits():
    eng = make_engine()
    seqs = _prefilled(eng, [5, 20])
    before = eng.pool.tensor.clone()
    one = eng.decode_step(seqs)
    eng.pool.tensor.copy_(before)
    torch.testing.assert_close(eng.decode_step(seqs, copy=False), one, atol=0, rtol=0)


def test_context_beyond_max_context_is_a_value_error():
    cfg = small_config()
    pool = KvPool(cfg, 16, 8)
    eng = Engine(cfg, random_weights(cfg), pool, max_context=40)
    pages = pool.alloc(6)
    eng.decode_step([DecodeSeq(pages, 39, 3)])
    with pytest.raises(ValueError, match="max_context"):
        eng.decode_step([DecodeSeq(pages, 40, 3)])
    with pytest.raises(ValueError, match="max_context"):
        Engine(cfg, random_weights(cfg), pool, max_context=cfg.max_position + 1)


def test_cuda_graphs_need_a_cuda_engine():
    cfg = small_config()
    with pytest.raises(ValueError, match="CUDA"):
        Engine(cfg, random_weights(cfg), KvPool(cfg, 4, 16), cuda_graphs=True)
    assert Engine(cfg, random_weights(cfg), KvPool(cfg, 4, 16)).graphs is None
    assert Engine(cfg, random_weights(cfg), KvPool(cfg, 4, 16)).capture_decode_graphs() == []


def test_out_of_range_ids_are_refused_before_any_write():
    eng = make_engine(num_pages=8)
    before = eng.pool.tensor.clone()
    with pytest.raises(ValueError, match="vocabulary"):
        eng.decode_step([DecodeSeq([0], 0, 512)])
    with pytest.raises(ValueError, match="vocabulary"):
        eng.decode_step([DecodeSeq([0], 0, -1)])
    with pytest.raises(ValueError, match="page id"):
        eng.decode_step([DecodeSeq([1], 0, 3), DecodeSeq([8], 3, 3)])
    assert torch.equal(eng.pool.tensor, before)


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(ValueError):
        buckets_for(0)
    graphs = DecodeGraphs(lambda rows: rows, "cpu", 4, 100)
    assert [graphs.bucket(b) for b in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]
    assert graphs.capture_all(10) == [1, 2, 4, 8, 16]  # uncaptured on CPU: only listed


def test_capture_oom_names_the_flags():
    """An OOM in capture, or an error raised while unwinding a capture that ran out of
    memory, becomes GraphOutOfMemory, whose message names what to change."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("capture invalidated") from None
    except RuntimeError as e:
        assert _out_of_memory(e)  # found through __context__
    assert not _out_of_memory(RuntimeError("other"))
    msg = str(GraphOutOfMemory(128))
    assert "128" in msg and "--max-batch" in msg and "--cuda-graphs off" in msg
