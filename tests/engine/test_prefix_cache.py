"""The prefix cache in the KV pool: what a page may hold before it is shared.

A stateful Hypothesis machine drives a small pool through interleavings of admit (look the
prompt up, allocate the rest), write (whole or partial pages, and late writes into the
pages of a request that already ended), fence, abort, finish and eviction by pressure. A
shadow of every page's contents checks that a page the cache serves always holds exactly
the KV of the tokens it is served for, and that the pool's counts stay exact.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from libs.engine.kvpool import KvPool, PoolExhausted, SharedPageWrite

from .conftest import small_config

PAGE = 4
CONFIG = small_config()


def pool(pages: int = 12) -> KvPool:
    p = KvPool(CONFIG, pages, PAGE)
    p.enable_prefix_cache("tiny@abc")
    return p


class Request:
    def __init__(self, tokens: list[int], pages: list[int], held: int) -> None:
        self.tokens, self.pages, self.held = tokens, pages, held
        self.written = held  # pages whose KV is complete (the held ones came complete)


class PrefixCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.pool = pool()
        self.content: dict[int, tuple] = {}  # page -> the tokens its KV was computed for
        self.live: list[Request] = []
        self.quarantined: list[Request] = []

    # Prompts share prefixes: a few base conversations, cut and extended.
    @rule(target=requests, base=st.sampled_from([(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                                                 (1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5),
                                                 (7, 7, 7, 7, 1, 2, 3, 4, 1, 2, 3, 4)]),
          cut=st.integers(1, 12), tail=st.lists(st.integers(0, 15), max_size=5))
    def admit(self, base, cut, tail):
        tokens = list(base[:cut]) + tail
        need = self.pool.pages_for(len(tokens))
        held = self.pool.match(tokens, (len(tokens) - 1) // PAGE)
        for i, page in enumerate(held):  # served pages hold exactly this prefix's KV
            assert self.content[page] == tuple(tokens[i * PAGE : (i + 1) * PAGE])
        try:
            fresh = self.pool.alloc(need - len(held))
        except PoolExhausted:
            self.pool.free(held)
            return None
        for page in fresh:
            self.content[page] = ("unwritten",)
        request = Request(tokens, held + fresh, len(held))
        self.live.append(request)
        return request

    @rule(request=requests, partial=st.booleans())
    def write(self, request, partial):
        """The next page of KV lands (or half of it: a write still in flight)."""
        if request not in self.live or request.written == len(request.pages):
            return
        page = request.pages[request.written]
        self.pool.check_private([page])  # never raises: fresh pages are private
        i = request.written
        chunk = tuple(request.tokens[i * PAGE : (i + 1) * PAGE])
        self.content[page] = chunk[:1] + ("partial",) if partial else chunk
        if not partial:
            request.written += 1

    @rule(request=consumes(requests))
    def fence_and_finish(self, request):
        """Every page complete and no write can land: seal, publish, free."""
        if request not in self.live or request.written < len(request.pages):
            return
        self.pool.seal(request.pages)
        self.pool.publish(request.tokens, request.pages)
        self.live.remove(request)
        self.pool.free(request.pages)

    @rule(request=consumes(requests), quarantine=st.booleans())
    def abort(self, request, quarantine):
        """Ends early, pages partly written: freed unsealed, or quarantined first."""
        if request not in self.live:
            return
        self.live.remove(request)
        if quarantine:
            self.quarantined.append(request)
        else:
            self.pool.free(request.pages)

    @rule(data=st.data())
    def late_write_then_fence(self, data):
        """A write that was in flight lands in a quarantined room, then its fence frees it."""
        if not self.quarantined:
            return
        request = data.draw(st.sampled_from(self.quarantined))
        for page in request.pages[request.held:]:
            self.content[page] = ("late write",)
        self.pool.publish(request.tokens, request.pages)  # never sealed: nothing enters
        self.quarantined.remove(request)
        self.pool.free(request.pages)

    @rule()
    def pressure(self):
        """A large allocation evicts idle cached pages, least recently used first."""
        n = self.pool.free_count
        if n:
            pages = self.pool.alloc(n)
            assert self.pool.cached == 0
            for page in pages:
                self.content[page] = ("other",)
            self.pool.free(pages)

    @invariant()
    def cached_pages_hold_their_tokens(self):
        cache = self.pool.cache
        for entry in cache._entries.values():
            assert self.content[entry.page] == entry.tokens
            with pytest.raises(SharedPageWrite):
                self.pool.check_private([entry.page])

    @invariant()
    def counts(self):
        held = {p for r in self.live + self.quarantined for p in r.pages}
        assert self.pool.used == len(held)
        assert self.pool.used + self.pool.free_count == self.pool.num_pages
        if not held:
            assert self.pool.used == 0


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)


def test_collision_is_detected_and_never_served():
    p = KvPool(CONFIG, 8, PAGE)
    p.enable_prefix_cache("tiny@abc", hasher=lambda parent, tokens: b"same key")
    pages = p.alloc(2)
    p.seal(pages)
    assert p.publish([1, 2, 3, 4, 5, 6, 7, 8], pages) == 1  # page 2 collides with page 1
    p.free(pages)
    assert p.match([9, 9, 9, 9, 1], 1) == []
    assert p.cache.collisions == 2


def test_unsealed_pages_never_enter():
    p = pool(4)
    pages = p.alloc(2)
    p.seal(pages[:1])
    assert p.publish([1, 2, 3, 4, 5, 6, 7, 8], pages) == 1
    p.free(pages)
    assert p.cached == 1 and p.used == 0
    assert p.match([1, 2, 3, 4, 5, 6, 7, 8, 9], 2) == [pages[0]]


def test_other_model_never_shares():
    a, b = pool(4), KvPool(CONFIG, 4, PAGE)
    b.enable_prefix_cache("tiny@other")
    for p in (a, b):
        pages = p.alloc(1)
        p.seal(pages)
        p.publish([1, 2, 3, 4], pages)
        p.free(pages)
    assert a.cache._entries.keys().isdisjoint(b.cache._entries.keys())


def test_pinned_pages_survive_eviction_pressure():
    """An admission pins its hits before it allocates: the pressure it causes itself,
    or any later one, evicts only pages nobody holds."""
    p = pool(4)
    first = p.alloc(3)
    p.seal(first)
    p.publish(list(range(12)), first)
    p.free(first)
    assert p.cached == 3 and p.used == 0
    held = p.match(list(range(8)) + [99], 2)
    assert held == first[:2]
    extra = p.alloc(2)  # evicts the one idle page, then the free one
    assert set(extra).isdisjoint(held)
    with pytest.raises(PoolExhausted):
        p.alloc(1)
    p.free(extra)
    p.free(held)
    assert p.used == 0 and p.cached == 2


def test_zero_capacity_means_off():
    p = KvPool(CONFIG, 4, PAGE)
    assert p.match([1, 2, 3, 4, 5], 1) == [] and p.publish([1, 2, 3, 4], [0]) == 0
    assert p.cached == 0
