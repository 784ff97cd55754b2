"""Paged KV cache: one tensor, allocated once, page-major.

Layout ``[num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]``: a page holds K and V of
``page_size`` consecutive positions for every layer, so one page is one contiguous byte range.
The KV transfer registers ``tensor`` once and moves whole pages as (address, length) descriptors.
"""

from __future__ import annotations

from bisect import bisect_left, insort
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
        # Free pages as maximal runs of consecutive ids: by start, by end (to merge a freed
        # run with its neighbours) and by (length, start) (to find the run a request fits).
        self._runs: dict[int, int] = {0: num_pages}  # start -> length
        self._run_ends: dict[int, int] = {num_pages: 0}  # end (exclusive) -> start
        self._by_size: list[tuple[int, int]] = [(num_pages, 0)]
        self._free = num_pages
        self._is_free = [True] * num_pages

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def free_count(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.num_pages - self._free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, as few runs of consecutive ids as the pool allows.

        A request's KV travels as one NIXL descriptor per run that is consecutive on both
        ends, and per-descriptor cost dominates a transfer. So: the smallest free run that
        holds all ``n`` pages (best fit, lowest ids on a tie), which keeps the large runs
        for large requests; when none does, the largest runs first. Ascending ids.
        """
        if n < 0:
            raise ValueError("cannot allocate a negative number of pages")
        if n > self._free:
            raise PoolExhausted(n, self._free)
        pages: list[int] = []
        fit = bisect_left(self._by_size, (n, -1))
        if fit < len(self._by_size):
            pages = self._take(*self._by_size[fit], n)
        while len(pages) < n:  # no run holds them all
            largest = bisect_left(self._by_size, (self._by_size[-1][0], -1))
            length, start = self._by_size[largest]
            pages += self._take(length, start, min(length, n - len(pages)))
        pages.sort()
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
        ordered = sorted(pages)
        run_start = 0
        for i in range(1, len(ordered) + 1):  # each run of consecutive freed ids
            if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
                self._give_back(ordered[run_start], i - run_start)
                run_start = i
        self._free += len(pages)

    def _take(self, length: int, start: int, k: int) -> list[int]:
        """The first ``k`` pages of the free run ``[start, start + length)``."""
        self._drop_run(start, length)
        if k < length:
            self._add_run(start + k, length - k)
        self._free -= k
        return list(range(start, start + k))

    def _give_back(self, start: int, count: int) -> None:
        """A freed run of pages, merged with the free runs on either side."""
        if (left := self._run_ends.get(start)) is not None:
            length = self._runs[left]
            self._drop_run(left, length)
            start, count = left, count + length
        if (length := self._runs.get(start + count)) is not None:
            self._drop_run(start + count, length)
            count += length
        self._add_run(start, count)

    def _add_run(self, start: int, length: int) -> None:
        self._runs[start] = length
        self._run_ends[start + length] = start
        insort(self._by_size, (length, start))

    def _drop_run(self, start: int, length: int) -> None:
        del self._runs[start], self._run_ends[start + length]
        del self._by_size[bisect_left(self._by_size, (length, start))]

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
