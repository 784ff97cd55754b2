"""The lifecycle's timeouts keep their order; a set that breaks it is refused at once."""

from __future__ import annotations

import dataclasses

import pytest

from libs.member.timeouts import TIMEOUTS, Timeouts


def test_the_defaults_keep_every_rule():
    t = Timeouts()
    assert t == TIMEOUTS
    assert all(getattr(t, f.name) > 0 for f in dataclasses.fields(t))
    assert t.fence_seconds < t.prefill_release_seconds  # a fence ends inside its release
    assert t.fence_seconds <= t.abort_wait_seconds  # an Abort outwaits the prefill's fence
    assert t.decode_release_seconds <= t.abort_wait_seconds  # and the decode's release
    assert t.abort_wait_seconds < t.writer_abort_seconds  # the ack beats the call's deadline


@pytest.mark.parametrize("budget", [0.001, 0.1, 0.5, 2.0, 30.0, 300.0])
def test_the_kv_wait_ends_before_the_calls_deadline(budget):
    wait = TIMEOUTS.kv_wait(budget)
    assert 0 < wait < budget
    assert budget - wait == pytest.approx(min(TIMEOUTS.kv_wait_margin, budget / 4))


@pytest.mark.parametrize("remaining", [0.5, 2.0, 300.0])
def test_the_routers_legs_end_before_its_callers_deadline(remaining):
    assert TIMEOUTS.leg_budget(remaining) == pytest.approx(remaining - TIMEOUTS.deadline_margin)
    assert TIMEOUTS.leg_budget(0.0) > 0  # an expired caller still gets a (tiny) positive budget


@pytest.mark.parametrize(("changes", "names"), [
    ({"prefill_release_seconds": 5.0}, ("fence_seconds", "prefill_release_seconds")),
    ({"fence_seconds": 5.5}, ("fence_seconds", "abort_wait_seconds")),
    ({"decode_release_seconds": 5.5}, ("decode_release_seconds", "abort_wait_seconds")),
    ({"writer_abort_seconds": 5.0}, ("abort_wait_seconds", "writer_abort_seconds")),
    ({"abort_wait_seconds": 1.0}, ("fence_seconds", "abort_wait_seconds")),
])
def test_a_misordered_set_is_refused_naming_the_rule(changes, names):
    with pytest.raises(ValueError) as refused:
        dataclasses.replace(TIMEOUTS, **changes)
    assert all(name in str(refused.value) for name in names), refused.value


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Timeouts)])
@pytest.mark.parametrize("value", [0, -1.0])
def test_a_timeout_that_is_not_positive_is_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be positive"):
        dataclasses.replace(TIMEOUTS, **{name: value})


def test_a_consistent_shorter_set_is_accepted():
    short = dataclasses.replace(
        TIMEOUTS, fence_seconds=0.1, prefill_release_seconds=0.2, decode_release_seconds=0.1,
        abort_wait_seconds=0.2, writer_abort_seconds=0.3,
    )
    assert short.abort_wait_seconds == 0.2
