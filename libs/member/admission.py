"""Admit a room: the one place where a request gets per-room state and KV pages.

Shared by prefill and decode so both refuse the same way: a key that already
ended here (aborted or served: a late leg or a replay) is ABORTED, a duplicate
is ALREADY_EXISTS, a full table or pool is RESOURCE_EXHAUSTED (the router queues the
request and tries again: capacity comes back), a request larger than the whole pool is
OUT_OF_RANGE (it never fits here: waiting would not help), and a refusal leaves
nothing behind.

With a prefix, the pages of its longest cached part are held first (pinned until the
request frees them, so the allocation that follows, and any eviction it causes, can never
take them) and only the rest is allocated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from libs.engine.kvpool import KvPool, PoolExhausted
from libs.kvpoll import DuplicateRoom, FailureCause, Room, RoomKey, RoomTable, TableFull
from libs.member.stats import RecentKeys
from libs.rpc.handlers import RpcError


def admit_room(
    table: RoomTable, pool: KvPool, ended: RecentKeys, key: RoomKey, n_pages: int,
    budget: float, prefix: Sequence[int] = (), max_hit_pages: int = 0,
) -> tuple[Room, list[int], int]:
    """Create the room (deadline `budget` seconds away) and give it `n_pages`: first the
    cached pages of `prefix` (at most `max_hit_pages`), then fresh ones. Returns the room,
    its pages and how many of them came from the cache."""
    if key in ended:
        raise RpcError(grpc.StatusCode.ABORTED, "room already ended here (aborted or served)")
    if n_pages > pool.num_pages:
        raise RpcError(
            grpc.StatusCode.OUT_OF_RANGE,
            f"KV pool exhausted: the request needs {n_pages} pages, more than the whole "
            f"pool ({pool.num_pages})",
        )
    try:
        room = table.create(key, deadline=time.monotonic() + budget)
    except DuplicateRoom as e:
        raise RpcError(grpc.StatusCode.ALREADY_EXISTS, str(e)) from e
    except TableFull as e:
        raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
    held = pool.match(prefix, min(max_hit_pages, n_pages)) if prefix else []
    try:
        pages = held + pool.alloc(n_pages - len(held))
    except PoolExhausted as e:
        pool.free(held)
        room.fail(FailureCause.REJECTED, time.monotonic())
        table.remove(key)
        raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
    return room, pages, len(held)
