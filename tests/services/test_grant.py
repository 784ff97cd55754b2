"""TransferInfo grants: only the decode's own, unaltered, unexpired grant for this writer."""

from __future__ import annotations

import secrets

import pytest

from libs.member import grant
from pdmesh.v1 import common_pb2 as cpb

KEY = secrets.token_bytes(32)
WRITER = cpb.PeerRef(name="prefill-0", epoch=11)


def info() -> cpb.TransferInfo:
    i = cpb.TransferInfo(
        key=cpb.RoomKey(room=b"r" * 16, generation=5),
        decode=cpb.PeerRef(name="decode-0", epoch=7),
        dst_pages=[4, 5, 9],
    )
    grant.sign(KEY, i, WRITER)
    return i


def test_a_valid_grant_passes():
    assert grant.check(KEY, info(), WRITER) is None


@pytest.mark.parametrize("tamper", [
    lambda i: setattr(i.key, "generation", 6),
    lambda i: setattr(i.key, "room", b"s" * 16),
    lambda i: setattr(i.decode, "epoch", 8),
    lambda i: i.dst_pages.__setitem__(2, 10),
    lambda i: i.dst_pages.append(11),
    lambda i: setattr(i, "grant_expires_unix_ms", i.grant_expires_unix_ms + 1),
    lambda i: setattr(i, "grant", secrets.token_bytes(32)),
])
def test_any_altered_field_is_refused(tamper):
    i = info()
    tamper(i)
    assert "does not match" in grant.check(KEY, i, WRITER)


def test_another_writer_or_key_or_an_expired_grant_is_refused():
    assert grant.check(KEY, info(), cpb.PeerRef(name="prefill-1", epoch=11))
    assert grant.check(KEY, info(), cpb.PeerRef(name="prefill-0", epoch=12))
    assert grant.check(secrets.token_bytes(32), info(), WRITER)
    assert grant.check(b"", info(), WRITER)
    expired = cpb.TransferInfo()
    expired.CopyFrom(info())
    grant.sign(KEY, expired, WRITER, seconds=-1)
    assert "expired" in grant.check(KEY, expired, WRITER)
