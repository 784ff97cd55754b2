"""Pool layout and descriptor coalescing, pure and NIXL-free so they are easy to test.

A pool is one contiguous, page-major tensor: page ``i`` is the byte range
``[base + i * page_bytes, base + (i + 1) * page_bytes)``. Peers exchange layouts so the
writer can address the reader's pages and both sides can refuse mismatched page sizes.
"""

from __future__ import annotations

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


def coalesce(src_pages: list[int], dst_pages: list[int]) -> list[Run]:
    """Merge page pairs into runs of consecutive ids on both sides.

    Per-descriptor cost dominates a transfer, so a prompt whose pages are contiguous on both
    ends becomes one descriptor. Pairs are sorted by source id first; the order of
    descriptors inside one WRITE does not matter because destinations are distinct.
    """
    runs: list[Run] = []
    for src, dst in sorted(zip(src_pages, dst_pages, strict=True)):
        last = runs[-1] if runs else None
        if last and src == last.src + last.count and dst == last.dst + last.count:
            runs[-1] = Run(last.src, last.dst, last.count + 1)
        else:
            runs.append(Run(src, dst, 1))
    return runs


def descriptors(layout: PoolLayout, starts: list[int], counts: list[int]) -> np.ndarray:
    """An Nx3 uint64 array of (address, length, device id), NIXL's descriptor format."""
    out = np.empty((len(starts), 3), dtype=np.uint64)
    out[:, 0] = [layout.base_addr + s * layout.page_bytes for s in starts]
    out[:, 1] = [c * layout.page_bytes for c in counts]
    out[:, 2] = layout.device_id
    return out


def check_pages(layout: PoolLayout, pages: list[int], side: str) -> None:
    """Raise LayoutMismatch naming ``side`` if a page id is outside the pool."""
    for page in pages:
        if not 0 <= page < layout.num_pages:
            raise LayoutMismatch(f"{side} page {page} outside pool of {layout.num_pages}")
