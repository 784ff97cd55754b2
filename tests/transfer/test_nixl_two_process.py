"""Real NIXL (UCX) between this process (prefill side) and a spawned decode process."""

from __future__ import annotations

import itertools
import time

import anyio
import pytest
import torch

from libs.transfer import (
    KvAgent,
    LayoutMismatch,
    PeerExists,
    PoolLayout,
    TransferFailed,
    TransferTimeout,
    UnknownPeer,
    wait,
)

from .peer import POISON, Peer

PAGES = 32
PAGE_BYTES = 64 * 1024
_names = itertools.count()


@pytest.fixture
def prefill() -> KvAgent:
    """A prefill-side agent over a pool of random pages (fresh name per test)."""
    torch.manual_seed(0)
    pool = torch.randint(0, 255, (PAGES, PAGE_BYTES), dtype=torch.uint8)
    agent = KvAgent(f"prefill-{next(_names)}", pool, PAGE_BYTES)
    agent.pool = pool  # type: ignore[attr-defined]  # test access to the source bytes
    yield agent
    assert agent.close() == 0  # every test releases what it posts


def _write_and_check(prefill: KvAgent, peer: Peer, name: str, tag: bytes) -> None:
    src = [0, 1, 2, 7, 8, 20, 31]
    dst = [5, 6, 7, 0, 1, 30, 12]
    layout = PoolLayout.from_dict(peer.layout_dict)
    xfer = prefill.write_pages(name, layout, src, dst, notif=tag)
    assert xfer.descriptors == 4  # [0..2]->[5..7], [7,8]->[0,1], 20->30, 31->12
    import anyio

    anyio.run(wait, xfer, time.monotonic() + 10)
    assert xfer.seconds is not None and xfer.gbps is not None and xfer.gbps > 0
    assert xfer.bytes == len(src) * PAGE_BYTES
    assert xfer.release()
    assert peer.call("notifs", 10) == [(prefill.name, tag)]
    got = peer.call("pool")
    source: torch.Tensor = prefill.pool  # type: ignore[attr-defined]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(got[d], source[s]), f"page {s}->{d} differs"
    untouched = sorted(set(range(PAGES)) - set(dst))
    assert bool((got[untouched] == POISON).all()), "a page not targeted was written"


def test_write_noncontiguous_pages_with_notification(prefill: KvAgent) -> None:
    peer = Peer("decode-a", PAGES, PAGE_BYTES)
    try:
        name = prefill.add_peer(peer.metadata)
        assert name == "decode-a"
        _write_and_check(prefill, peer, name, b"room-1/0")
    finally:
        peer.stop()


def test_restarted_peer_same_name(prefill: KvAgent) -> None:
    first = Peer("decode-r", PAGES, PAGE_BYTES)
    try:
        name = prefill.add_peer(first.metadata)
        _write_and_check(prefill, first, name, b"before")
    finally:
        first.stop()
    second = Peer("decode-r", PAGES, PAGE_BYTES)
    try:
        assert second.metadata != first.metadata
        with pytest.raises(PeerExists):  # the stale agent must be dropped first
            prefill.add_peer(second.metadata)
        prefill.remove_peer(name)
        with pytest.raises(UnknownPeer):
            prefill.write_pages(name, PoolLayout.from_dict(second.layout_dict), [0], [0])
        assert prefill.add_peer(second.metadata) == name
        _write_and_check(prefill, second, name, b"after")
    finally:
        second.stop()


def test_vanished_peer_fails_typed_within_deadline(prefill: KvAgent) -> None:
    peer = Peer("decode-v", PAGES, PAGE_BYTES)
    name = prefill.add_peer(peer.metadata)
    layout = PoolLayout.from_dict(peer.layout_dict)
    peer.kill()
    import anyio

    start = time.monotonic()
    deadline = start + 5.0
    with pytest.raises((TransferFailed, TransferTimeout)) as caught:
        xfer = prefill.write_pages(name, layout, list(range(PAGES)), list(range(PAGES)))
        try:
            anyio.run(wait, xfer, deadline)
        finally:
            xfer.release()
    assert time.monotonic() - start < 5.0 + 1.0
    print(f"vanished peer: {caught.type.__name__} after {time.monotonic() - start:.2f}s")
    prefill.remove_peer(name)


def test_layout_mismatch_refused(prefill: KvAgent) -> None:
    peer = Peer("decode-m", PAGES, PAGE_BYTES // 2)
    try:
        name = prefill.add_peer(peer.metadata)
        layout = PoolLayout.from_dict(peer.layout_dict)
        with pytest.raises(LayoutMismatch):
            prefill.write_pages(name, layout, [0], [0])
    finally:
        peer.stop()


def test_close_counts_handles_never_released() -> None:
    """A write whose handle is never released is a leak that close() reports (a clean
    stop then fails on it); one its owner marked withheld is not counted."""
    pool = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
    agent = KvAgent(f"prefill-{next(_names)}", pool, PAGE_BYTES)
    peer = Peer("decode-l", PAGES, PAGE_BYTES)
    try:
        name = agent.add_peer(peer.metadata)
        layout = PoolLayout.from_dict(peer.layout_dict)
        kept = [agent.write_pages(name, layout, [i], [i]) for i in range(3)]
        for xfer in kept:
            anyio.run(wait, xfer, time.monotonic() + 10)
        assert agent.unreleased == 3
        assert kept[0].release() and agent.unreleased == 2
        kept[1].withheld = True
        assert agent.close() == 1  # kept[2]; kept[1] was withheld
        assert agent.unreleased == 0 and all(x.released for x in kept)
    finally:
        peer.stop()
