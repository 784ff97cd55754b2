"""A write's time and rate: from just before its post to the first poll that saw DONE."""

from __future__ import annotations

import time

from libs.transfer.agent import Transfer


class Scripted:
    """A NIXL agent answering status checks from a script (the last answer repeats)."""

    def __init__(self, states: list[str]) -> None:
        self.states = states

    def check_xfer_state(self, handle: object) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def test_seconds_and_gbps_are_set_once_done_was_seen() -> None:
    posted = time.perf_counter()
    transfer = Transfer(object(), Scripted(["PROC", "DONE"]), "PROC", 10**9, 1, set(),
                        posted)  # type: ignore[arg-type]
    assert transfer.seconds is None and transfer.gbps is None
    assert transfer.poll() == "PROC" and transfer.seconds is None
    time.sleep(0.01)
    assert transfer.poll() == "DONE"
    seconds = transfer.seconds
    assert seconds is not None and 0.01 <= seconds <= time.perf_counter() - posted
    assert transfer.gbps == 10**9 / seconds / 1e9
    time.sleep(0.01)
    transfer.poll()
    assert transfer.seconds == seconds  # timed once, at the first DONE


def test_a_write_done_at_its_post_is_timed_by_the_post() -> None:
    transfer = Transfer(object(), Scripted(["DONE"]), "DONE", 4096, 1, set())  # type: ignore[arg-type]
    assert transfer.seconds is not None and transfer.seconds >= 0


def test_a_failed_write_has_no_rate() -> None:
    transfer = Transfer(object(), Scripted(["ERR"]), "PROC", 4096, 1, set())  # type: ignore[arg-type]
    assert transfer.poll() == "ERR"
    assert transfer.seconds is None and transfer.gbps is None
