"""Paged KV cache: one tensor, allocated once, page-major.

Layout ``[num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]``: a page holds K and V of
``page_size`` consecutive positions for every layer, so one page is one contiguous byte range.
The KV transfer registers ``tensor`` once and moves whole pages as (address, length) descriptors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from .config import ModelConfig


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: requested {requested} pages, {free} free")
        self.requested = requested
        self.free = free


class KvPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.config = config
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, config.n_layers, 2, config.n_kv_heads, page_size, config.head_dim)
        self.tensor = torch.zeros(shape, device=device, dtype=dtype)
        self.page_bytes = self.tensor[0].numel() * self.tensor.element_size()
        # Min-heap of free pages: low indices first, so a request's pages tend to be contiguous.
        self._free_heap: list[int] = list(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def free_count(self) -> int:
        return len(self._free_heap)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free_heap)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > len(self._free_heap):
            raise PoolExhausted(n, len(self._free_heap))
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; validates all of them before freeing any."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"unknown page {p}")
            if self._is_free[p] or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
            heapq.heappush(self._free_heap, p)

    def page_view(self, page: int) -> torch.Tensor:
        """[n_layers, 2, n_kv_heads, page_size, head_dim], a view of one contiguous page."""
        return self.tensor[page]

    def page_ptr(self, page: int) -> int:
        """Device address of a page: base + page * page_bytes."""
        return self.tensor.data_ptr() + page * self.page_bytes

    def copy_pages(
        self, src_pool: KvPool, src_pages: Sequence[int], dst_pages: Sequence[int]
    ) -> None:
        """Copy whole pages from another pool (a stand-in for the KV transfer in tests)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("src_pages and dst_pages differ in length")
        if src_pool.tensor.shape[1:] != self.tensor.shape[1:]:
            raise ValueError("pools have different page shapes")
        if not src_pages:
            return
        src = torch.tensor(list(src_pages), device=src_pool.device)
        dst = torch.tensor(list(dst_pages), device=self.device)
        self.tensor[dst] = src_pool.tensor[src].to(self.device, self.dtype)
