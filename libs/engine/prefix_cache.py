"""The prefix cache's index: full KV pages by a chained hash of their tokens.

A page's key hashes the key of the page before it and this page's token ids, starting
from the model fingerprint, so one key names a whole prefix and different weights never
share a page. Keys are only an index: a lookup walks the prompt page by page and serves a
page only when its stored token ids and its parent key both match, so a hash collision is
counted and never served.

Reference counts say how many live requests hold a cached page; a cached page no request
holds is idle, kept in least-recently-used order and given back to the pool only when the
pool runs out of free pages (libs/engine/kvpool.py owns that decision). This module never
decides *whether* a page may enter: the pool admits only sealed pages (complete, and no
write can still touch them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Hasher = Callable[[bytes, Sequence[int]], bytes]
# Told of every change to the index: ("stored" | "removed", the page keys). The member
# streams these to the router (libs/member/kv_events.py), which routes by them.
Listener = Callable[[str, list[bytes]], None]


def chained_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding ``tokens`` after the prefix whose key is ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def root_key(fingerprint: str) -> bytes:
    """The parent key of a prompt's first page: the model's, so weights never share."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


def page_keys(fingerprint: str, page_size: int, tokens: Sequence[int]) -> list[bytes]:
    """The keys of the full pages of ``tokens``, as the cache of that model names them
    (the router matches them against the members' cache events)."""
    keys, parent = [], root_key(fingerprint)
    for i in range(len(tokens) // page_size):
        parent = chained_hash(parent, tokens[i * page_size : (i + 1) * page_size])
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Entry:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    page: int


class PrefixCache:
    def __init__(self, fingerprint: str, page_size: int, hasher: Hasher = chained_hash):
        self.page_size = page_size
        self.root = root_key(fingerprint)
        self._hash = hasher
        self._entries: dict[bytes, Entry] = {}
        self._by_page: dict[int, Entry] = {}
        self._refs: dict[int, int] = {}  # cached page -> live requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest use first
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.collisions = 0
        self.listener: Listener | None = None

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    @property
    def idle(self) -> int:
        """Cached pages no request holds: free-able on demand."""
        return len(self._idle)

    def keys(self) -> list[bytes]:
        """Every cached page's key (what a new subscriber to the events starts from)."""
        return list(self._entries)

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The cached pages of the longest prefix of ``tokens`` (at most ``max_pages``),
        each verified by its token ids and parent, and held (reference taken)."""
        self.queries += 1
        self.query_tokens += len(tokens)
        pages: list[int] = []
        parent = self.root
        for i in range(min(max_pages, len(tokens) // self.page_size)):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            key = self._hash(parent, chunk)
            entry = self._entries.get(key)
            if entry is None:
                break
            if entry.tokens != chunk or entry.parent != parent:
                self.collisions += 1  # same key, other tokens: never served
                break
            pages.append(entry.page)
            parent = key
        for page in pages:
            self.hold(page)
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def hold(self, page: int) -> None:
        self._refs[page] += 1
        self._idle.pop(page, None)

    def release(self, page: int) -> bool:
        """Drop one request's reference to ``page``; False if it is not cached (the
        caller frees it). A page no request holds becomes idle, most recently used."""
        if page not in self._by_page:
            return False
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._idle[page] = None
        return True

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Index the held full pages ``pages`` of ``tokens`` (page i holds tokens of page
        i). A page whose prefix is cached elsewhere already stays out (the caller frees
        it). The caller keeps its reference. Returns the pages that entered."""
        parent, stored = self.root, []
        for i, page in enumerate(pages[: len(tokens) // self.page_size]):
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            key = self._hash(parent, chunk)
            existing = self._entries.get(key)
            if existing is None and page not in self._by_page:
                entry = Entry(key, parent, chunk, page)
                self._entries[key] = self._by_page[page] = entry
                self._refs[page] = 1
                stored.append(key)
            elif existing is not None and (existing.tokens != chunk or existing.parent != parent):
                self.collisions += 1
                break  # a collision: what follows would chain from the wrong prefix
            parent = key
        if stored and self.listener is not None:
            self.listener("stored", stored)
        return len(stored)

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently used idle pages; returns them for the pool."""
        out, removed = [], []
        while len(out) < n and self._idle:
            page, _ = self._idle.popitem(last=False)
            entry = self._by_page.pop(page)
            del self._entries[entry.key], self._refs[page]
            out.append(page)
            removed.append(entry.key)
        if removed and self.listener is not None:
            self.listener("removed", removed)
        return out
