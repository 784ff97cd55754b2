"""transfer: KV page transfer over NIXL (one agent per process, one owner thread)."""

from libs.transfer.agent import KvAgent, Transfer
from libs.transfer.errors import (
    LayoutMismatch,
    PeerExists,
    TransferError,
    TransferFailed,
    TransferTimeout,
    UnknownPeer,
)
from libs.transfer.kvwire import Nvfp4PageFormat, UnsupportedKvShape
from libs.transfer.layout import PoolLayout, Run, coalesce
from libs.transfer.staging import KvWire
from libs.transfer.wait import wait

__all__ = [
    "KvAgent",
    "KvWire",
    "LayoutMismatch",
    "Nvfp4PageFormat",
    "PeerExists",
    "PoolLayout",
    "Run",
    "Transfer",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "UnknownPeer",
    "UnsupportedKvShape",
    "coalesce",
    "wait",
]
