"""NIXL reports some failures by raising, not by answering ERR; callers see one ERR.

A decode SIGKILLed while a prefill's write is in flight makes ``check_xfer_state`` raise
NIXL_ERR_REMOTE_DISCONNECT. Escaping the poll, the exception would escape the prefill's
release too, which would then keep that room and its KV pages forever (docs/incidents.md).
These tests use the binding's own exception class on a stand-in agent: a real peer cannot
be killed at exactly that instant on demand (CMA writes on one host finish inside the
post).
"""

from __future__ import annotations

import logging
import time

import anyio
import pytest
import torch
from nixl import _bindings

from libs.transfer import KvAgent, TransferFailed, wait
from libs.transfer.agent import Transfer


class Disconnected:
    """A NIXL agent whose peer vanished: every status check raises, as the binding does."""

    def __init__(self) -> None:
        self.checks = 0

    def check_xfer_state(self, handle: object) -> str:
        self.checks += 1
        raise _bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")


class Handle:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


def test_poll_turns_a_raised_disconnect_into_err_once() -> None:
    agent, handle = Disconnected(), Handle()
    transfer = Transfer(handle, agent, "PROC", 4096, 1, set())  # type: ignore[arg-type]
    assert transfer.poll() == "ERR"
    assert transfer.poll() == "ERR"
    assert agent.checks == 1  # terminal: NIXL is not asked again
    assert "nixlRemoteDisconnectError" in transfer.error
    assert transfer.release() and handle.released


async def test_wait_fails_typed_with_the_backend_reason() -> None:
    transfer = Transfer(Handle(), Disconnected(), "PROC", 4096, 1, set())  # type: ignore[arg-type]
    with anyio.fail_after(2), pytest.raises(TransferFailed, match="REMOTE_DISCONNECT"):
        await wait(transfer, time.monotonic() + 1)


def test_get_notifs_survives_a_raising_backend(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    pool = torch.zeros((2, 4096), dtype=torch.uint8)
    agent = KvAgent("notif-raises", pool, 4096)
    try:
        def vanished() -> dict:
            raise _bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

        monkeypatch.setattr(agent._agent, "get_new_notifs", vanished)
        with caplog.at_level(logging.WARNING, logger="libs.transfer.agent"):
            for _ in range(1000):  # the decode polls about every millisecond
                assert agent.get_notifs() == []  # its one notification loop lives on
        warned = [r for r in caplog.records if "get_new_notifs failed" in r.getMessage()]
        assert len(warned) == 1  # rate-limited, not a line per poll
        monkeypatch.undo()
        assert agent.get_notifs() == []  # and the real agent still answers
    finally:
        agent.close()
