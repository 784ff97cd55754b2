"""The bench's workloads and figures, and its two in-process sides (the engine alone and
transformers) serving them on the tiny model: arrivals kept, every token counted, the
same greedy tokens on both."""

from __future__ import annotations

import io
import random

import pytest
import torch

from pdmesh.bench.progress import Progress
from pdmesh.bench.workload import Lengths, Record, Request, Workload, percentiles, summarize


def test_lengths_are_fixed_or_uniform_ranges():
    assert Lengths.parse("128") == Lengths(128, 128)
    assert Lengths.parse("64:256") == Lengths(64, 256)
    rng = random.Random(0)
    drawn = {Lengths.parse("3:5").draw(rng) for _ in range(200)}
    assert drawn == {3, 4, 5}
    for bad in ("0", "5:3", "x", "1:y"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_poisson_arrivals_are_seeded_and_near_the_rate():
    reqs = [Request(i, [1], 1) for i in range(2000)]
    w = Workload("w", reqs, concurrency=1, rate=50.0, seed=7)
    times = w.arrivals()
    assert times == Workload("w", reqs, 1, 50.0, seed=7).arrivals()
    assert times != Workload("w", reqs, 1, 50.0, seed=8).arrivals()
    assert times[0] == 0.0 and times == sorted(times)
    assert 45 < len(times) / times[-1] < 55


def test_percentiles_interpolate_between_ranks():
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == 50.5 and p["max"] == 100
    assert percentiles([])["p50"] is None


def test_a_piece_of_several_tokens_spreads_its_gap_over_them():
    # sent at 0; first token at 0.1; then a piece of 3 tokens 0.3 s later, one more 0.1 later
    r = Record(0.0, [(0.1, 1), (0.4, 3), (0.5, 1)], list(range(5)))
    f = summarize([r], [5])
    assert f["ttft_s"]["p50"] == pytest.approx(0.1) and f["e2e_s"]["max"] == pytest.approx(0.5)
    assert f["itl_s"]["mean"] == pytest.approx(0.1)  # 3 x 0.1 and 1 x 0.1: four gaps
    assert f["output_tok_s"] == pytest.approx(10.0)  # 5 tokens in 0.5 s
    assert f["stream_decode_tok_s"]["p50"] == pytest.approx(10.0)  # 4 tokens in 0.4 s
    short = summarize([Record(0.0, [(0.1, 2)])], [3])
    assert short["completed"] == 0 and short["errors"] == {"short: 2 of 3 tokens": 1}


@pytest.fixture(scope="module")
def tiny():
    from libs.engine.loader import load_model

    return load_model("tiny")


def _requests(tiny, n: int) -> list[Request]:
    rng = random.Random(3)
    return [Request(i, [rng.randrange(5, 1000) for _ in range(rng.randint(4, 40))],
                    rng.randint(1, 9)) for i in range(n)]


def quiet(label: str, n: int) -> Progress:
    return Progress(label, n, stream=io.StringIO())


def test_the_engine_alone_and_transformers_serve_the_same_greedy_tokens(tiny):
    from pdmesh.bench import hf
    from pdmesh.bench.engine import EngineAlone

    reqs = _requests(tiny, 7)
    closed = Workload("closed", reqs, concurrency=3)
    opened = Workload("open", reqs, concurrency=3, rate=200.0, seed=1)
    alone = EngineAlone(tiny, [closed, opened], max_batch=4)
    model = hf.load_transformers("tiny", "cpu", torch.float32)
    for load in (closed, opened):
        engine = alone.serve(load, quiet("engine", 7))
        baseline = hf.serve(model, 2, load, quiet("transformers", 7))
        for side in (engine, baseline):
            assert [r.tokens for r in side] == [r.output_tokens for r in reqs]
            assert all(r.error is None and r.pieces[0][0] >= r.sent for r in side)
        assert [r.token_ids for r in engine] == [r.token_ids for r in baseline]
        assert alone.pool.used == 0  # every page came back
    # open loop: each request is sent at its arrival time; closed loop: never more than
    # three in flight, the next sent when one ends
    for r, at in zip(alone.serve(opened, quiet("engine", 7)), opened.arrivals(), strict=True):
        assert r.sent == at
    served = alone.serve(closed, quiet("engine", 7))
    for r in served:
        in_flight = sum(1 for o in served if o.sent <= r.sent < o.pieces[-1][0])
        assert in_flight <= 3
