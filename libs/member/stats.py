"""Live counters every prefill and decode keeps, served by Admin.Stats."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from libs.engine.kvpool import KvPool
from libs.kvpoll import RoomKey, RoomTable
from pdmesh.v1 import common_pb2 as cpb


@dataclass
class Counters:
    requests_total: int = 0
    transfer_failed_total: int = 0
    aborts: Counter[str] = field(default_factory=Counter)

    def stats(self, role: int, name: str, epoch: int, healthy: bool, table: RoomTable,
              pool: KvPool, extra_inflight: int = 0) -> cpb.MemberStats:
        rooms = {state.name.lower(): count for state, count in table.counts().items() if count}
        return cpb.MemberStats(
            role=role,
            name=name,
            epoch=epoch,
            healthy=healthy,
            inflight=table.inflight + extra_inflight,
            kv_pages_used=pool.used,
            kv_pages_total=pool.num_pages,
            rooms=rooms,
            transfer_failed_total=self.transfer_failed_total,
            aborts_total=sum(self.aborts.values()),
            requests_total=self.requests_total,
        )


class RecentKeys:
    """A bounded set of recently aborted rooms: a leg that arrives after its Abort is refused."""

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
