"""Typed errors of the room table; each maps to one gRPC status at the service edge."""

from __future__ import annotations


class RoomError(Exception):
    """Base of every kvpoll error."""


class DuplicateRoom(RoomError):
    """A (room, generation) that already exists was created again (ALREADY_EXISTS)."""


class UnknownRoom(RoomError, KeyError):
    """A message named a room this table never minted or already removed (NOT_FOUND).

    Lookups never create state, so a forged or stale message cannot allocate anything.
    """


class TableFull(RoomError):
    """Creating one more room would pass ``max_rooms`` (RESOURCE_EXHAUSTED)."""


class NotTerminal(RoomError):
    """``remove`` was asked for a room that can still change (FAILED_PRECONDITION)."""


class WrongThread(RoomError, RuntimeError):
    """A write came from a thread other than the owning event loop's.

    Raised instead of silently racing: the table has no locks by design (see RoomTable).
    """
