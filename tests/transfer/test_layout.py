"""Descriptor coalescing and page checks (pure, no NIXL)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.transfer import LayoutMismatch, PoolLayout, Run, coalesce
from libs.transfer.layout import check_pages, descriptors


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
