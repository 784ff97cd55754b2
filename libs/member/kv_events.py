"""The KvEvents service: a member's prefix-cache changes, streamed to the router.

The prefix cache tells ``KvEventHub.record`` of every page key that entered or left it
(libs/engine/prefix_cache.py); each subscriber (a router) has its own bounded backlog.
A subscription starts with a SNAPSHOT of the whole cache, so a router that (re)starts, or
a member that restarted with an empty cache, begins from the truth and stays in step by
the STORED/REMOVED events that follow. A subscriber that falls more than ``max_backlog``
events behind is ended UNAVAILABLE rather than buffered without bound: it subscribes again
and gets a fresh SNAPSHOT. Every event names this member's epoch and model fingerprint,
which the router checks against the registration it paired with. Under mutual TLS only a
router's certificate may subscribe (page keys say which prompts a member has seen).

``record`` may be called from any thread (the pool's cache changes where pages are
allocated and freed): it only appends under a lock and wakes the subscriber's loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

import grpc

from libs.engine.prefix_cache import PrefixCache
from libs.rpc import tls
from libs.rpc.handlers import RpcError, contained
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import kvevents_pb2 as kpb
from pdmesh.v1 import kvevents_pb2_grpc as kgrpc

KINDS = {"stored": kpb.KvCacheEvent.STORED, "removed": kpb.KvCacheEvent.REMOVED}


class _Subscriber:
    def __init__(self, max_backlog: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.backlog: deque[tuple[int, list[bytes]]] = deque()
        self.max_backlog = max_backlog
        self.overflowed = False

    def push(self, kind: int, keys: list[bytes]) -> None:  # under the hub's lock
        if len(self.backlog) >= self.max_backlog:
            self.overflowed = True
        else:
            self.backlog.append((kind, keys))
        self.loop.call_soon_threadsafe(self.wake.set)


class KvEventHub:
    """Fans a cache's changes out to its subscribers; see the module docstring."""

    def __init__(self, cache: PrefixCache | None, max_backlog: int = 10_000) -> None:
        self.cache = cache
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._subscribers: list[_Subscriber] = []
        if cache is not None:
            cache.listener = self.record

    def record(self, kind: str, keys: list[bytes]) -> None:
        with self._lock:
            for subscriber in self._subscribers:
                subscriber.push(KINDS[kind], keys)

    def subscribe(self) -> tuple[_Subscriber, list[bytes]]:
        """A new subscriber and the cache's keys now: a change after this is in its
        backlog (one that raced the snapshot may be in both, which applying it again
        leaves as it is)."""
        subscriber = _Subscriber(self.max_backlog)
        with self._lock:
            self._subscribers.append(subscriber)
        return subscriber, self.cache.keys() if self.cache is not None else []

    def unsubscribe(self, subscriber: _Subscriber) -> None:
        with self._lock:
            self._subscribers.remove(subscriber)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)


class KvEventsService(kgrpc.KvEventsServicer):
    def __init__(self, hub: KvEventHub, me: Callable[[], cpb.PeerRef], model: str,
                 page_size: int) -> None:
        self.hub = hub
        self.me = me  # name and current epoch
        self.model = model
        self.page_size = page_size

    def _event(self, kind: int, keys: list[bytes]) -> kpb.KvCacheEvent:
        return kpb.KvCacheEvent(member=self.me(), model=self.model, kind=kind,
                                page_keys=keys, page_size=self.page_size,
                                enabled=self.hub.cache is not None)

    @contained
    async def Subscribe(self, request, context):
        role = tls.peer_role(context)  # None over plaintext (--insecure)
        if role is not None and role != "router":  # page keys say which prompts it holds
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"cache events are for routers; this is a {role} certificate")
        subscriber, keys = self.hub.subscribe()
        try:
            await context.write(self._event(kpb.KvCacheEvent.SNAPSHOT, keys))
            while True:
                await subscriber.wake.wait()
                subscriber.wake.clear()
                if subscriber.overflowed:
                    raise RpcError(grpc.StatusCode.UNAVAILABLE,
                                   "cache events: subscriber fell behind; subscribe again")
                while subscriber.backlog:
                    kind, batch = subscriber.backlog.popleft()
                    await context.write(self._event(kind, batch))
        finally:
            self.hub.unsubscribe(subscriber)
