"""Pool layout and descriptor coalescing, pure and NIXL-free so they are easy to test.

A pool is one contiguous, page-major tensor: page ``i`` is the byte range
``[base + i * page_bytes, base + (i + 1) * page_bytes)``. Peers exchange layouts so the
writer can address the reader's pages and both sides can refuse mismatched page sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from libs.transfer.errors import LayoutMismatch

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a peer's registered pool lives and how it is cut into pages."""

    base_addr: int
    page_bytes: int
    num_pages: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    def __post_init__(self) -> None:
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}")
        if self.page_bytes <= 0 or self.num_pages <= 0:
            raise ValueError("page_bytes and num_pages must be positive")

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for a registration message."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Run:
    """``count`` consecutive pages starting at ``src`` locally and ``dst`` remotely."""

    src: int
    dst: int
    count: int


PageIds = Sequence[int] | np.ndarray


def page_array(pages: PageIds) -> np.ndarray:
    """Page ids as a 1-D int64 array (a request's pages are a list; arrays pass through)."""
    return np.asarray(pages, dtype=np.int64).reshape(-1)


def runs(src_pages: PageIds, dst_pages: PageIds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maximal runs of page pairs consecutive on both sides, as (src starts, dst starts,
    counts) arrays.

    Per-descriptor cost dominates a transfer, so a prompt whose pages are contiguous on both
    ends becomes one descriptor. Pairs are sorted by source id (then destination id); the
    order of descriptors inside one WRITE does not matter because destinations are distinct.
    Vectorized: a WRITE of thousands of pages is prepared in tens of microseconds, less than
    the link needs to move them.
    """
    src, dst = page_array(src_pages), page_array(dst_pages)
    if src.size != dst.size:
        raise ValueError("src_pages and dst_pages differ in length")
    if not src.size:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    order = np.lexsort((dst, src))
    src, dst = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


def coalesce(src_pages: PageIds, dst_pages: PageIds) -> list[Run]:
    """:func:`runs` as a list of :class:`Run`."""
    return [Run(int(s), int(d), int(c)) for s, d, c in zip(*runs(src_pages, dst_pages),
                                                           strict=True)]


def descriptors(layout: PoolLayout, starts: PageIds, counts: PageIds) -> np.ndarray:
    """An Nx3 uint64 array of (address, length, device id), NIXL's descriptor format."""
    first, count = page_array(starts), page_array(counts)
    out = np.empty((first.size, 3), dtype=np.uint64)
    out[:, 0] = layout.base_addr + first.astype(np.uint64) * np.uint64(layout.page_bytes)
    out[:, 1] = count.astype(np.uint64) * np.uint64(layout.page_bytes)
    out[:, 2] = layout.device_id
    return out


def check_pages(layout: PoolLayout, pages: PageIds, side: str) -> None:
    """Raise LayoutMismatch naming ``side`` if a page id is outside the pool."""
    ids = page_array(pages)
    outside = (ids < 0) | (ids >= layout.num_pages)
    if outside.any():
        page = int(ids[np.argmax(outside)])
        raise LayoutMismatch(f"{side} page {page} outside pool of {layout.num_pages}")


@dataclass(frozen=True, slots=True)
class Plan:
    """One WRITE, checked: its descriptors on each side and its page count."""

    local: np.ndarray  # Nx3, see descriptors
    remote: np.ndarray
    pages: int

    @property
    def descriptors(self) -> int:
        return len(self.local)


def plan(local: PoolLayout, remote: PoolLayout, src_pages: PageIds, dst_pages: PageIds) -> Plan:
    """Check a WRITE of local ``src_pages`` into the peer's ``dst_pages`` and describe it in
    as few descriptors as the page ids allow (:func:`runs`). Raises LayoutMismatch.

    A request whose pages are one run on each side (what the pool allocators aim for) takes
    a path that builds no per-page arrays: one descriptor, checked at its two ends.
    """
    if remote.page_bytes != local.page_bytes:
        raise LayoutMismatch(f"page_bytes {local.page_bytes} != peer {remote.page_bytes}")
    n = len(src_pages)
    if not n or n != len(dst_pages):
        raise LayoutMismatch("src_pages and dst_pages must be equal-length and non-empty")
    src_first, dst_first = _run_start(src_pages), _run_start(dst_pages)
    if src_first is not None and dst_first is not None:
        for layout, first, side in ((local, src_first, "source"),
                                    (remote, dst_first, "destination")):
            if first < 0 or first + n > layout.num_pages:
                raise LayoutMismatch(f"{side} pages {first}..{first + n - 1} outside pool "
                                     f"of {layout.num_pages}")
        return Plan(_one(local, src_first, n), _one(remote, dst_first, n), n)
    src, dst = page_array(src_pages), page_array(dst_pages)
    ordered = np.sort(dst)
    if (ordered[1:] == ordered[:-1]).any():
        raise LayoutMismatch("duplicate destination pages")
    check_pages(local, src, "source")
    check_pages(remote, ordered[[0, -1]], "destination")
    src_starts, dst_starts, counts = runs(src, dst)
    return Plan(descriptors(local, src_starts, counts),
                descriptors(remote, dst_starts, counts), n)


def _one(layout: PoolLayout, first: int, count: int) -> np.ndarray:
    """descriptors() of one run, without the per-page array work."""
    row = [layout.base_addr + first * layout.page_bytes, count * layout.page_bytes,
           layout.device_id]
    return np.array([row], dtype=np.uint64)


def _run_start(pages: PageIds) -> int | None:
    """The first id when ``pages`` is a list of consecutive ascending ids, else None."""
    if not isinstance(pages, list) or not pages:
        return None
    first = pages[0]
    if pages[-1] != first + len(pages) - 1:  # cheap refusal before the full comparison
        return None
    return first if pages == list(range(first, first + len(pages))) else None
