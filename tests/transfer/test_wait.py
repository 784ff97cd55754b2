"""The application-owned deadline of ``wait`` (NIXL itself has no stall timeout)."""

from __future__ import annotations

import time

import anyio
import pytest

from libs.transfer import TransferFailed, TransferTimeout, wait


class Stuck:
    """A transfer that stays PROC forever, as a handle to a vanished peer can (nixl#2047)."""

    bytes = 1
    error = ""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.polls = 0

    def poll(self) -> str:
        self.polls += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


async def test_timeout_is_typed_and_on_time() -> None:
    start = time.monotonic()
    stuck = Stuck(["PROC"])
    with anyio.fail_after(2), pytest.raises(TransferTimeout):
        await wait(stuck, start + 0.2)  # type: ignore[arg-type]
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.5
    assert stuck.polls > 50  # backs off to ~1 ms, not to the deadline


async def test_err_and_done() -> None:
    with pytest.raises(TransferFailed):
        await wait(Stuck(["PROC", "PROC", "ERR"]), time.monotonic() + 1)  # type: ignore[arg-type]
    await wait(Stuck(["PROC", "DONE"]), time.monotonic() + 1)  # type: ignore[arg-type]
