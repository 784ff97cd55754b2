"""Live counters every prefill and decode keeps, served by Admin.Stats."""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.engine.kvpool import KvPool
from libs.kvpoll import FailureCause, RoomKey, RoomTable
from libs.member.timeouts import TIMEOUTS
from pdmesh.v1 import common_pb2 as cpb


@dataclass
class Counters:
    requests_total: int = 0
    transfer_failed_total: int = 0
    deadline_expired_total: int = 0
    prompt_tokens_computed_total: int = 0
    kv_bytes_moved_total: int = 0
    kv_bytes_skipped_total: int = 0
    aborts: Counter[str] = field(default_factory=Counter)

    def cancelled(self, deadline: float) -> FailureCause:
        """Why gRPC cancelled a handler: its deadline passed (counted), or its caller left."""
        if time.monotonic() >= deadline - 0.01:
            self.deadline_expired_total += 1
            return FailureCause.DEADLINE
        return FailureCause.CLIENT_DISCONNECT

    def stats(self, role: int, name: str, epoch: int, healthy: bool, table: RoomTable,
              pool: KvPool, peer_of: Callable[[RoomKey], str] = lambda key: "",
              pinned_after: float = TIMEOUTS.pinned_after, requests: int | None = None
              ) -> cpb.MemberStats:
        """`requests`: the member's requests not yet released (a decoding sequence
        is in flight although its room already succeeded); default the live rooms."""
        cache = getattr(pool, "cache", None)  # None: prefix caching off
        rooms = {state.name.lower(): count for state, count in table.counts().items() if count}
        return cpb.MemberStats(
            role=role,
            name=name,
            epoch=epoch,
            healthy=healthy,
            inflight=max(table.inflight, requests or 0),
            kv_pages_used=pool.used,
            kv_pages_total=pool.num_pages,
            rooms=rooms,
            transfer_failed_total=self.transfer_failed_total,
            aborts_total=sum(self.aborts.values()),
            requests_total=self.requests_total,
            pinned=pinned_rooms(table, time.monotonic(), pinned_after, peer_of),
            pid=os.getpid(),
            deadline_expired_total=self.deadline_expired_total,
            aborts_by_reason=dict(self.aborts),
            prompt_tokens_computed_total=self.prompt_tokens_computed_total,
            kv_pages_cached=cache.idle if cache else 0,
            prefix_cache_queries_total=cache.queries if cache else 0,
            prefix_cache_query_tokens_total=cache.query_tokens if cache else 0,
            prefix_cache_hits_total=cache.hit_tokens if cache else 0,
            kv_transfer_bytes_moved_total=self.kv_bytes_moved_total,
            kv_transfer_bytes_skipped_total=self.kv_bytes_skipped_total,
        )


def pinned_rooms(
    table: RoomTable, now: float, after: float, peer_of: Callable[[RoomKey], str]
) -> list[cpb.PinnedRoom]:
    """Rooms not terminal and without a state change for `after` seconds, oldest first.

    Idle because there is no work is not pinned; a room stuck in one state is.
    """
    out = [
        cpb.PinnedRoom(
            room=room.key.room.hex(),
            generation=room.key.generation,
            state=room.state.proto,
            age_seconds=now - room.created_at,
            idle_seconds=now - room.last_progress_at,
            peer=peer_of(room.key),
        )
        for room in table
        if not room.terminal and now - room.last_progress_at >= after
    ]
    return sorted(out, key=lambda p: -p.idle_seconds)


class RecentKeys:
    """A bounded set of rooms that recently ended (aborted or served) on this member:
    a leg that arrives after its Abort, or a replayed message, is refused."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._keys: OrderedDict[RoomKey, None] = OrderedDict()

    def add(self, key: RoomKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def __contains__(self, key: RoomKey) -> bool:
        return key in self._keys
