"""One room: its key, state, first failure cause, deadline and a terminal wake-up.

All writes go through :func:`libs.kvpoll.transition.decide`, synchronously and without
awaits, so on the owning event loop a transition is atomic by construction.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import anyio

from libs.kvpoll.errors import WrongThread
from libs.kvpoll.states import FailureCause, RoomState
from libs.kvpoll.transition import Outcome, decide

ROOM_ID_BYTES = 16


@dataclass(frozen=True, slots=True)
class RoomKey:
    """(room, generation): minted by the router, never taken from clients."""

    room: bytes
    generation: int

    def __post_init__(self) -> None:
        if not isinstance(self.room, bytes) or len(self.room) != ROOM_ID_BYTES:
            raise ValueError(f"room id must be {ROOM_ID_BYTES} bytes")
        if self.generation < 0:
            raise ValueError("generation must be >= 0")


class Room:
    """State of one request's KV handoff on one service.

    ``deadline`` is a ``time.monotonic()`` instant; every non-terminal state has one and a
    transition may replace it (e.g. a fresh budget per chunk). Writes are only accepted from
    the thread that created the room (the event loop's), see :class:`WrongThread`.
    """

    __slots__ = (
        "key",
        "state",
        "failure_cause",
        "deadline",
        "created_at",
        "last_progress_at",
        "_owner",
        "_terminal_event",
    )

    def __init__(self, key: RoomKey, *, deadline: float, now: float) -> None:
        self.key = key
        self.state = RoomState.BOOTSTRAPPING
        self.failure_cause: FailureCause | None = None
        self.deadline = deadline
        self.created_at = now
        self.last_progress_at = now
        self._owner = threading.get_ident()
        self._terminal_event: anyio.Event | None = None

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def transition(
        self,
        target: RoomState,
        now: float,
        *,
        cause: FailureCause | None = None,
        deadline: float | None = None,
    ) -> Outcome:
        """Attempt ``target``; returns the outcome instead of raising.

        ``cause`` is required for Failed and forbidden otherwise. ``deadline`` replaces the
        current one when the move applies and the new state is non-terminal.
        """
        if threading.get_ident() != self._owner:
            raise WrongThread(f"room {self.key} written off its owning thread")
        if (target is RoomState.FAILED) != (cause is not None):
            raise ValueError("a cause is required for FAILED and only for FAILED")
        outcome = decide(self.state, target)
        if outcome is not Outcome.APPLIED:
            return outcome
        self.state = target
        self.last_progress_at = now
        if target is RoomState.FAILED:
            self.failure_cause = FailureCause(cause)
        if target.terminal:
            if self._terminal_event is not None:
                self._terminal_event.set()
        elif deadline is not None:
            self.deadline = deadline
        return outcome

    def fail(self, cause: FailureCause, now: float) -> Outcome:
        """Shorthand for ``transition(FAILED, now, cause=cause)``."""
        return self.transition(RoomState.FAILED, now, cause=cause)

    def expired(self, now: float) -> bool:
        """Non-terminal and past its deadline."""
        return not self.terminal and now >= self.deadline

    async def wait_terminal(self) -> RoomState:
        """Wait until the room is Success or Failed; returns that state.

        Wrap it in a timeout of your own; the room's deadline is enforced by
        ``RoomTable.expire``, not here.
        """
        if self.terminal:
            return self.state
        if self._terminal_event is None:
            self._terminal_event = anyio.Event()
        await self._terminal_event.wait()
        return self.state

    def __repr__(self) -> str:
        cause = f", cause={self.failure_cause}" if self.failure_cause else ""
        return f"Room({self.key.room.hex()}/{self.key.generation}, {self.state.name}{cause})"
