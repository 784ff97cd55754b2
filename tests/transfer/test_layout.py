"""Descriptor coalescing, write plans and page checks (pure, no NIXL)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.transfer import LayoutMismatch, PoolLayout, Run, coalesce
from libs.transfer.layout import check_pages, descriptors, plan


def test_coalesce_merges_runs_on_both_sides() -> None:
    assert coalesce([0, 1, 2, 7, 8], [5, 6, 7, 0, 1]) == [Run(0, 5, 3), Run(7, 0, 2)]
    assert coalesce([3, 4], [1, 9]) == [Run(3, 1, 1), Run(4, 9, 1)]
    assert coalesce(list(range(256)), list(range(100, 356))) == [Run(0, 100, 256)]


@given(st.lists(st.integers(0, 200), unique=True, max_size=64), st.randoms())
def test_coalesce_covers_every_pair_exactly(src: list[int], rnd: object) -> None:
    dst = list(range(len(src)))
    rnd.shuffle(dst)  # type: ignore[attr-defined]
    runs = coalesce(src, dst)
    pairs = {(r.src + i, r.dst + i) for r in runs for i in range(r.count)}
    assert pairs == set(zip(src, dst, strict=True))
    assert sum(r.count for r in runs) == len(src)


def test_descriptors_and_bounds() -> None:
    layout = PoolLayout(base_addr=4096, page_bytes=100, num_pages=10, mem_type="DRAM",
                        device_id=0)
    d = descriptors(layout, [0, 3], [2, 1])
    assert d.tolist() == [[4096, 200, 0], [4396, 100, 0]]
    check_pages(layout, [0, 9], "dst")
    with pytest.raises(LayoutMismatch):
        check_pages(layout, [10], "dst")
    assert PoolLayout.from_dict(layout.to_dict()) == layout


LOCAL = PoolLayout(base_addr=1 << 20, page_bytes=100, num_pages=64, mem_type="VRAM",
                   device_id=0)
REMOTE = PoolLayout(base_addr=1 << 30, page_bytes=100, num_pages=32, mem_type="VRAM",
                    device_id=1)


def test_plan_of_one_run_each_side_is_one_descriptor() -> None:
    write = plan(LOCAL, REMOTE, list(range(10, 26)), list(range(4, 20)))
    assert write.descriptors == 1 and write.pages == 16
    assert write.local.tolist() == [[(1 << 20) + 1000, 1600, 0]]
    assert write.remote.tolist() == [[(1 << 30) + 400, 1600, 1]]


@given(st.lists(st.integers(0, 63), unique=True, min_size=1, max_size=32), st.randoms())
def test_plan_matches_coalesce_whatever_the_ids(src: list[int], rnd: object) -> None:
    dst = rnd.sample(range(REMOTE.num_pages), len(src))  # type: ignore[attr-defined]
    if rnd.random() < 0.3:  # type: ignore[attr-defined]
        src, dst = sorted(src), list(range(len(src)))  # often one run on one side or both
    write = plan(LOCAL, REMOTE, src, dst)
    expected = coalesce(src, dst)
    assert write.descriptors == len(expected) and write.pages == len(src)
    assert write.local[:, 0].tolist() == [LOCAL.base_addr + r.src * 100 for r in expected]
    assert write.remote[:, 0].tolist() == [REMOTE.base_addr + r.dst * 100 for r in expected]
    assert write.local[:, 1].tolist() == [r.count * 100 for r in expected]


def test_plan_refuses_what_does_not_fit() -> None:
    for src, dst in [
        ([], []),
        ([0, 1], [0]),
        ([0, 1], [3, 3]),  # duplicate destination
        (list(range(60, 65)), list(range(5))),  # the run leaves the local pool
        ([0, 1], [31, 32]),  # ... the peer's
        ([0, 5], [40, 2]),  # scattered, out of the peer's pool
        ([-1, 0], [0, 1]),
    ]:
        with pytest.raises(LayoutMismatch):
            plan(LOCAL, REMOTE, src, dst)
    with pytest.raises(LayoutMismatch):  # pages of other sizes
        plan(LOCAL, PoolLayout.from_dict({**REMOTE.to_dict(), "page_bytes": 50}), [0], [0])
