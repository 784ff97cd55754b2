"""kvpoll: the per-room KV handoff state machine (terminal states absorb)."""

from libs.kvpoll.errors import (
    DuplicateRoom,
    NotTerminal,
    RoomError,
    TableFull,
    UnknownRoom,
    WrongThread,
)
from libs.kvpoll.room import ROOM_ID_BYTES, Room, RoomKey
from libs.kvpoll.states import RANK, TERMINAL, FailureCause, RoomState
from libs.kvpoll.table import RoomTable
from libs.kvpoll.transition import Outcome, decide

__all__ = [
    "RANK",
    "ROOM_ID_BYTES",
    "TERMINAL",
    "DuplicateRoom",
    "FailureCause",
    "NotTerminal",
    "Outcome",
    "Room",
    "RoomError",
    "RoomKey",
    "RoomState",
    "RoomTable",
    "TableFull",
    "UnknownRoom",
    "WrongThread",
    "decide",
]
