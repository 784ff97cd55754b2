"""`pinned_rooms`: live rooms without progress past the threshold, and only those."""

from __future__ import annotations

from libs.kvpoll import FailureCause, RoomKey, RoomState, RoomTable
from libs.member.stats import pinned_rooms
from pdmesh.v1 import common_pb2 as cpb


def key(i: int) -> RoomKey:
    return RoomKey(bytes([i]) * 16, i)


def test_only_stuck_live_rooms_are_pinned():
    table = RoomTable(8)
    stuck = table.create(key(1), deadline=1e9, now=0.0)
    stuck.transition(RoomState.TRANSFERRING, now=1.0)
    moving = table.create(key(2), deadline=1e9, now=0.0)
    moving.transition(RoomState.WAITING_FOR_INPUT, now=19.0)
    failed = table.create(key(3), deadline=1e9, now=0.0)
    failed.fail(FailureCause.CLIENT_DISCONNECT, now=0.5)  # terminal: never pinned
    pinned = pinned_rooms(table, now=20.0, after=10.0, peer_of=lambda k: f"peer-{k.generation}")
    assert [(p.room, p.state, p.peer) for p in pinned] == [
        (key(1).room.hex(), cpb.TRANSFERRING, "peer-1")
    ]
    assert pinned[0].idle_seconds == 19.0 and pinned[0].age_seconds == 20.0
    assert pinned_rooms(table, now=5.0, after=10.0, peer_of=lambda k: "") == []
