"""The member's cache-event stream (libs/member/kv_events.py) without processes: a
subscription starts with a snapshot of the cache, then carries every stored and removed
key in order; a subscriber that falls behind its bound is ended UNAVAILABLE (it subscribes
again and gets a fresh snapshot) and the hub forgets it."""

from __future__ import annotations

import anyio
import grpc
import pytest

from libs.engine.prefix_cache import PrefixCache, page_keys
from libs.member.kv_events import KvEventHub, KvEventsService
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import kvevents_pb2 as kpb

MODEL = "tiny@abc"


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.sent: list[kpb.KvCacheEvent] = []
        self.code: grpc.StatusCode | None = None

    def auth_context(self) -> dict:
        return {}  # plaintext: no peer certificate

    async def write(self, message) -> None:
        self.sent.append(message)

    async def abort(self, code, message, *metadata):
        self.code = code
        raise Aborted(message)


def service(cache: PrefixCache | None, max_backlog: int = 100) -> KvEventsService:
    return KvEventsService(KvEventHub(cache, max_backlog), lambda: cpb.PeerRef(name="d", epoch=7),
                           MODEL, 16)


async def test_snapshot_then_changes_in_order():
    cache = PrefixCache(MODEL, 16)
    tokens = list(range(64))
    cache.insert(tokens[:32], [0, 1])
    svc, context = service(cache), FakeContext()
    async with anyio.create_task_group() as tg:
        tg.start_soon(svc.Subscribe, kpb.KvEventsRequest(), context)
        await anyio.sleep(0.05)
        cache.insert(tokens, [0, 1, 2, 3])  # pages 2 and 3 enter
        for page in (0, 1, 2, 3):
            cache.release(page)
        cache.evict(1)
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    keys = page_keys(MODEL, 16, tokens)
    kinds = [(e.kind, list(e.page_keys)) for e in context.sent]
    assert kinds == [(kpb.KvCacheEvent.SNAPSHOT, keys[:2]), (kpb.KvCacheEvent.STORED, keys[2:]),
                     (kpb.KvCacheEvent.REMOVED, keys[:1])]
    assert all(e.member.epoch == 7 and e.model == MODEL and e.enabled for e in context.sent)
    assert svc.hub.subscribers == 0


async def test_a_subscriber_that_falls_behind_is_ended_unavailable():
    cache = PrefixCache(MODEL, 16)
    svc, context = service(cache, max_backlog=2), FakeContext()

    async def subscribe() -> None:
        with pytest.raises(Aborted):
            await svc.Subscribe(kpb.KvEventsRequest(), context)

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscribe)
        await anyio.sleep(0.05)
        for i in range(5):  # no await between: the loop cannot drain the backlog
            cache.insert(list(range(100 * i, 100 * i + 16)), [i])
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert svc.hub.subscribers == 0


async def test_no_cache_is_an_empty_snapshot_marked_disabled():
    svc, context = service(None), FakeContext()
    async with anyio.create_task_group() as tg:
        tg.start_soon(svc.Subscribe, kpb.KvEventsRequest(), context)
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    [snapshot] = context.sent
    assert snapshot.kind == kpb.KvCacheEvent.SNAPSHOT and not snapshot.page_keys
    assert not snapshot.enabled
