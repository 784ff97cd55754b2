"""Room states and failure causes.

The numeric values are the protobuf enum's, so a state crosses the wire as the same int on
every service. They are *not* an ordering to take a ``max()`` over: that is what revived a
Failed room in the field report (Failed=0 < Transferring=3). Ordering lives in ``RANK``,
and only among non-terminal states; terminal states are handled before any comparison.
"""

from __future__ import annotations

from enum import Enum, StrEnum


class RoomState(Enum):
    """Where a room is in its life; values match the ``RoomState`` protobuf enum."""

    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5

    @property
    def proto(self) -> int:
        """The protobuf enum number (stable; never reorder)."""
        return self.value

    @classmethod
    def from_proto(cls, number: int) -> RoomState:
        """Parse a wire value; raises ValueError for 0/unknown so forged values are refused."""
        return cls(number)

    @property
    def terminal(self) -> bool:
        """Success and Failed absorb: nothing ever leaves them."""
        return self in TERMINAL


TERMINAL: frozenset[RoomState] = frozenset({RoomState.SUCCESS, RoomState.FAILED})

# Forward order among the non-terminal states only.
RANK: dict[RoomState, int] = {
    RoomState.BOOTSTRAPPING: 0,
    RoomState.WAITING_FOR_INPUT: 1,
    RoomState.TRANSFERRING: 2,
}


class FailureCause(StrEnum):
    """Why a room failed; a closed set so metrics labels stay bounded."""

    CLIENT_DISCONNECT = "client_disconnect"
    DEADLINE = "deadline"
    PEER_LOST = "peer_lost"
    REJECTED = "rejected"
    SHUTDOWN = "shutdown"
    INTERNAL = "internal"
    TRANSFER_ERROR = "transfer_error"
