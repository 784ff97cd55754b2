"""RoomTable: the bounded set of rooms one service holds.

Ownership: the table belongs to one event loop and is only touched from that loop's thread.
Every operation is synchronous with no ``await`` inside, so on that loop each operation is
atomic and no lock is needed. We deliberately do not add a lock: a lock would make the
state word safe but the terminal wake-up (an ``anyio.Event``) still must be set on the loop,
and worker threads (engine step loop, anything blocking) must hand results to the loop
anyway (``anyio.from_thread.run_sync`` or a memory object stream). Writes from another
thread raise :class:`WrongThread` rather than racing silently.

The resurrection race of the field report was a *logic* race (a ``max()`` over states), not
a memory race; the absorbing rule in :mod:`libs.kvpoll.transition` closes it for any
interleaving of writers, which the property tests check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from libs.kvpoll.errors import DuplicateRoom, NotTerminal, TableFull, UnknownRoom
from libs.kvpoll.room import Room, RoomKey
from libs.kvpoll.states import FailureCause, RoomState
from libs.kvpoll.transition import Outcome


class RoomTable:
    """Bounded map (room, generation) -> Room with deadline sweeps and bulk failure.

    Counts per state are computed on demand from the rooms themselves (the table is bounded,
    so this is cheap) rather than kept as a second source of truth that a direct
    ``Room.transition`` could leave stale.
    """

    def __init__(self, max_rooms: int) -> None:
        if max_rooms <= 0:
            raise ValueError("max_rooms must be positive")
        self.max_rooms = max_rooms
        self._rooms: dict[RoomKey, Room] = {}

    def create(self, key: RoomKey, *, deadline: float, now: float | None = None) -> Room:
        """Mint state for a new room in Bootstrapping; refuses duplicates and overflow.

        Terminal rooms count against the bound until ``remove``d: their pages may still
        be fenced by the caller.
        """
        if key in self._rooms:
            raise DuplicateRoom(f"room {key.room.hex()}/{key.generation} exists")
        if len(self._rooms) >= self.max_rooms:
            raise TableFull(f"room table full ({self.max_rooms})")
        room = Room(key, deadline=deadline, now=_now(now))
        self._rooms[key] = room
        return room

    def get(self, key: RoomKey) -> Room:
        """The room for ``key``; :class:`UnknownRoom` if absent (never creates)."""
        try:
            return self._rooms[key]
        except KeyError:
            raise UnknownRoom(f"unknown room {key.room.hex()}/{key.generation}") from None

    def transition(
        self,
        key: RoomKey,
        target: RoomState,
        now: float | None = None,
        *,
        cause: FailureCause | None = None,
        deadline: float | None = None,
    ) -> Outcome:
        """Look up ``key`` and attempt ``target`` (see :meth:`Room.transition`)."""
        return self.get(key).transition(target, _now(now), cause=cause, deadline=deadline)

    def fail(self, key: RoomKey, cause: FailureCause, now: float | None = None) -> Outcome:
        """Fail one room; a no-op outcome if it is already terminal."""
        return self.get(key).fail(cause, _now(now))

    def expire(self, now: float) -> list[RoomKey]:
        """Fail every non-terminal room whose deadline is <= ``now`` with cause deadline.

        Contract: the caller drains pending events (notifications, transfer completions,
        results already received) *before* calling this, so a room whose success has
        arrived is not failed for lateness. ``now`` is explicit so the caller controls
        that order and tests control time.
        """
        expired = [room for room in self._rooms.values() if room.expired(now)]
        for room in expired:
            room.fail(FailureCause.DEADLINE, now)
        return [room.key for room in expired]

    def fail_where(
        self,
        predicate: Callable[[Room], bool],
        cause: FailureCause,
        now: float | None = None,
    ) -> list[RoomKey]:
        """Fail every non-terminal room matching ``predicate`` (e.g. a dead peer's epoch)."""
        at = _now(now)
        hit = [r for r in self._rooms.values() if not r.terminal and predicate(r)]
        for room in hit:
            room.fail(cause, at)
        return [room.key for room in hit]

    def remove(self, key: RoomKey) -> Room:
        """Drop a terminal room; :class:`NotTerminal` if it can still change."""
        room = self.get(key)
        if not room.terminal:
            raise NotTerminal(f"room {key.room.hex()}/{key.generation} is {room.state.name}")
        del self._rooms[key]
        return room

    def counts(self) -> dict[RoomState, int]:
        """Rooms per state, every state present (feeds a ``rooms{state}`` gauge)."""
        out = dict.fromkeys(RoomState, 0)
        for room in self._rooms.values():
            out[room.state] += 1
        return out

    @property
    def inflight(self) -> int:
        """Non-terminal rooms: must drain to 0 after load stops."""
        return sum(1 for room in self._rooms.values() if not room.terminal)

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, key: object) -> bool:
        return key in self._rooms

    def __iter__(self) -> Iterator[Room]:
        return iter(list(self._rooms.values()))


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
