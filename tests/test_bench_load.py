"""The load benchmark's figures (pdmesh/bench/load.py): the sweep's levels, the requests
(seeded, sized in words), goodput against both SLOs, refusals by code, and the queue and
preemption figures read from metrics deltas."""

from __future__ import annotations

import pytest

from pdmesh.bench.load import (
    MeshFigures,
    chat_requests,
    concurrency_list,
    goodput,
    level_figures,
)
from pdmesh.bench.workload import Lengths, Record


def test_concurrency_levels_parse_and_bad_ones_are_refused():
    assert concurrency_list("8,16,48") == [8, 16, 48]
    assert concurrency_list("4") == [4]
    for bad in ("0", "8,x", "", "-1,2"):
        with pytest.raises(ValueError):
            concurrency_list(bad)


def test_requests_are_seeded_and_within_their_ranges():
    a = chat_requests(50, Lengths(50, 700), Lengths(32, 256), seed=3)
    b = chat_requests(50, Lengths(50, 700), Lengths(32, 256), seed=3)
    assert [r.messages for r in a] == [r.messages for r in b]
    assert all(32 <= r.output_tokens <= 256 for r in a)
    sizes = [len(r.messages[0]["content"].split()) - 4 for r in a]  # less the instruction
    assert min(sizes) >= 50 and max(sizes) <= 700 and len(set(sizes)) > 10


def test_goodput_needs_both_slos_and_a_completed_request():
    fast = Record(0.0, [(0.5, 1), (0.55, 1), (0.60, 1)])
    slow_first = Record(0.0, [(3.0, 1), (3.05, 1)])
    slow_gaps = Record(0.0, [(0.5, 1), (1.5, 1)])
    failed = Record(0.0, [(0.5, 1)], error="UNAVAILABLE")
    assert goodput([fast, slow_first, slow_gaps, failed], 2.0, 0.1) == [
        True, False, False, False]


def test_refused_counts_429_and_503_only():
    records = [Record(0.0, [(0.1, 1)]), Record(0.0, error="429"), Record(0.0, error="503"),
               Record(0.0, error="500")]
    f = level_figures(records, 10.0, http=True, ttft_slo=2, itl_slo=0.1, queue={},
                      preemptions=None)
    assert f["refused"] == 2 and f["refused_fraction"] == 0.5 and f["completed"] == 1
    assert f["goodput"] == 1 and f["goodput_req_s"] == 0.1


def test_queue_and_preemption_figures_are_deltas_and_absent_when_not_exposed():
    before = {"router": {"pdmesh_queue_time_seconds_count": 2.0,
                         "pdmesh_queue_time_seconds_sum": 1.0,
                         "pdmesh_queue_time_seconds_bucket{le=0.005}": 1.0}}
    after = {"router": {"pdmesh_queue_time_seconds_count": 12.0,
                        "pdmesh_queue_time_seconds_sum": 6.0,
                        "pdmesh_queue_time_seconds_bucket{le=0.005}": 5.0}}
    assert MeshFigures.queue(before, after) == {"requests": 10, "mean_s": 0.5, "waited": 6}
    assert MeshFigures.preemptions(before, after) is None
    after["decode-0"] = {"pdmesh_preemptions_total": 4.0}
    assert MeshFigures.preemptions(before, after) == 4.0
    assert MeshFigures.queue({}, {"decode-0": {}})["requests"] is None
