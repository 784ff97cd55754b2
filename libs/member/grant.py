"""Grants: a decode's signature on the pages it lets one prefill write.

The decode signs (room, generation, its own name and epoch, the writer's name
and epoch, the destination pages, an expiry) with a per-process key it
publishes in its registration. The prefill checks the signature before it
creates any state or moves any byte, so a TransferInfo that a live decode did
not issue to this very prefill, or one replayed after it expired, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

from pdmesh.v1 import common_pb2 as cpb

GRANT_SECONDS = 600.0


def _message(info: cpb.TransferInfo, writer: cpb.PeerRef) -> bytes:
    parts = [
        info.key.room,
        struct.pack(">Q", info.key.generation),
        info.decode.name.encode(),
        struct.pack(">Q", info.decode.epoch),
        writer.name.encode(),
        struct.pack(">Q", writer.epoch),
        struct.pack(f">{len(info.dst_pages)}I", *info.dst_pages),
        struct.pack(">Q", info.grant_expires_unix_ms),
        struct.pack(">I", info.held_pages),
    ]
    # length-prefix every part so no two field lists serialize alike
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def sign(key: bytes, info: cpb.TransferInfo, writer: cpb.PeerRef,
         seconds: float = GRANT_SECONDS) -> None:
    """Fill info.grant and its expiry, in place."""
    info.grant_expires_unix_ms = int((time.time() + seconds) * 1000)
    info.grant = hmac.new(key, _message(info, writer), hashlib.sha256).digest()


def check(key: bytes, info: cpb.TransferInfo, writer: cpb.PeerRef) -> str | None:
    """Why `info` is not a valid grant for `writer`, or None when it is."""
    if not key:
        return "the decode published no grant key"
    if info.grant_expires_unix_ms < time.time() * 1000:
        return "the grant has expired"
    expected = hmac.new(key, _message(info, writer), hashlib.sha256).digest()
    if not hmac.compare_digest(expected, info.grant):
        return "the grant does not match (forged, altered, or issued to another writer)"
    return None
