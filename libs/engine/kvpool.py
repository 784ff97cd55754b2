"""Paged KV cache: one tensor, allocated once, page-major.

Layout ``[num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]``: a page holds K and V of
``page_size`` consecutive positions for every layer, so one page is one contiguous byte range.
The KV transfer registers ``tensor`` once and moves whole pages as (address, length) descriptors.

With a prefix cache (``enable_prefix_cache``), full pages whose KV is complete can outlive
their request and be shared by later ones (libs/engine/prefix_cache.py). A page enters
only once it is *sealed*: its request said that its KV is complete and that no write can
still touch it (the prefill's writes fenced, the decode's KvReady landed and its sequence
out of the batch). A page freshly allocated is unsealed; a request that ends any other way
(aborted, failed, preempted, quarantined) frees its pages without sealing them, so they
can never be shared. Cached pages that no request holds count as free: ``alloc`` evicts
the least recently used of them only when the truly free pages run out.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence

import torch

from .config import ModelConfig
from .prefix_cache import Hasher, PrefixCache, chained_hash


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: requested {requested} pages, {free} free")
        self.requested = requested
        self.free = free


class SharedPageWrite(RuntimeError):
    """A write aimed at pages the prefix cache shares; nothing was written."""

    def __init__(self, pages: list[int]) -> None:
        super().__init__(f"refused: pages {pages} are shared by the prefix cache")
        self.pages = pages


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
        self._sealed = [False] * num_pages  # complete, and no write can still touch it
        self.cache: PrefixCache | None = None

    def enable_prefix_cache(self, fingerprint: str, hasher: Hasher = chained_hash) -> None:
        """Keep full sealed pages for later requests of the same model (``fingerprint``)."""
        self.cache = PrefixCache(fingerprint, self.page_size, hasher)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def free_count(self) -> int:
        """Pages an allocation can have: free ones and cached ones no request holds."""
        return self._free + self.cached

    @property
    def used(self) -> int:
        """Pages held by live requests (a shared cached page counts once)."""
        return self.num_pages - self.free_count

    @property
    def cached(self) -> int:
        """Cached pages no request holds."""
        return self.cache.idle if self.cache is not None else 0

    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The cached pages of the longest prefix of ``tokens`` (at most ``max_pages``),
        held for the caller until it frees them; [] without a cache."""
        if self.cache is None or max_pages <= 0:
            return []
        return self.cache.match(tokens, max_pages)

    def seal(self, pages: Iterable[int]) -> None:
        """The caller's word that these held pages' KV is complete and that no write can
        still touch them: from now on they may enter the cache."""
        for p in pages:
            if self._is_free[p] or (self.cache is not None and self.cache.is_idle(p)):
                raise ValueError(f"sealing page {p}, which no request holds")
            self._sealed[p] = True

    def publish(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Offer a request's full pages (page i holds ``tokens`` of page i) to the cache,
        up to the first page not sealed; the caller still frees them. Returns the pages
        that entered."""
        if self.cache is None:
            return 0
        sealed = 0
        while sealed < len(pages) and self._sealed[pages[sealed]]:
            sealed += 1
        return self.cache.insert(tokens, pages[:sealed])

    def check_private(self, pages: Iterable[int]) -> None:
        """Refuse a write into a page that the cache shares (its KV is read by others)."""
        if self.cache is not None:
            shared = [p for p in pages if p in self.cache]
            if shared:
                raise SharedPageWrite(shared)

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
        if n > self.free_count:
            raise PoolExhausted(n, self.free_count)
        if n > self._free:  # cached pages no request holds go, least recently used first
            self._free_now(self.cache.evict(n - self._free))
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
            self._sealed[p] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Let go of a request's pages: a cached one loses a holder (and stays cached),
        any other goes back. Validates all of them before freeing any."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"unknown page {p}")
            idle = self.cache is not None and self.cache.is_idle(p)
            if self._is_free[p] or idle or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        if self.cache is not None:
            pages = [p for p in pages if not self.cache.release(p)]
        self._free_now(pages)

    def _free_now(self, pages: list[int]) -> None:
        for p in pages:
            self._is_free[p] = True
            self._sealed[p] = False
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
