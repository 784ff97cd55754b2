"""Property tests: arbitrary interleavings of several writers on one room."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.kvpoll import RANK, FailureCause, Outcome, Room, RoomKey, RoomState, decide

KEY = RoomKey(b"\x01" * 16, 0)

ops = st.tuples(st.sampled_from(list(RoomState)), st.sampled_from(list(FailureCause)))
writer = st.lists(ops, max_size=8)


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[RoomState, FailureCause]]:
    """Several writers' sequences, interleaved in an arbitrary order (each keeps its order)."""
    writers = draw(st.lists(writer, min_size=1, max_size=5))
    queues = [list(w) for w in writers]
    merged: list[tuple[RoomState, FailureCause]] = []
    while any(queues):
        live = [i for i, q in enumerate(queues) if q]
        merged.append(queues[draw(st.sampled_from(live))].pop(0))
    return merged


def _apply(room: Room, op: tuple[RoomState, FailureCause], now: float) -> Outcome:
    target, cause = op
    return room.transition(target, now, cause=cause if target is RoomState.FAILED else None)


@given(schedules())
def test_interleavings_keep_invariants(schedule: list[tuple[RoomState, FailureCause]]) -> None:
    room = Room(KEY, deadline=100.0, now=0.0)
    first_terminal: tuple[RoomState, FailureCause | None] | None = None
    for step, op in enumerate(schedule, start=1):
        before = room.state
        outcome = _apply(room, op, float(step))
        assert outcome is decide(before, op[0])
        if first_terminal is not None:
            # Terminal absorbs: state and first cause never change again.
            assert outcome is Outcome.IGNORED_TERMINAL
            assert (room.state, room.failure_cause) == first_terminal
            continue
        if room.state.terminal:
            first_terminal = (room.state, room.failure_cause)
            if room.state is RoomState.FAILED:
                assert room.failure_cause is op[1]
            else:
                assert room.failure_cause is None
        else:
            # Never backward among non-terminal states.
            assert RANK[room.state] >= RANK[before]
            if outcome is Outcome.REFUSED_BACKWARD:
                assert room.state is before
    failures = [op for op in schedule if op[0] is RoomState.FAILED]
    terminals = [op for op in schedule if op[0].terminal]
    if terminals and terminals[0][0] is RoomState.FAILED:
        assert room.state is RoomState.FAILED
        assert room.failure_cause is failures[0][1]
    if not terminals:
        assert not room.terminal


@given(st.sampled_from(list(RoomState)), st.sampled_from(list(RoomState)))
def test_decide_table(current: RoomState, target: RoomState) -> None:
    outcome = decide(current, target)
    if current.terminal:
        assert outcome is Outcome.IGNORED_TERMINAL
    elif target.terminal or RANK[target] >= RANK[current]:
        assert outcome is Outcome.APPLIED
    else:
        assert outcome is Outcome.REFUSED_BACKWARD


def test_resurrection_sequence_stays_failed() -> None:
    """The field report's incident: abort sets Failed, a racing worker writes Transferring,
    then a late Success arrives. The room must stay Failed with the first cause."""
    room = Room(KEY, deadline=100.0, now=0.0)
    assert room.transition(RoomState.WAITING_FOR_INPUT, 1.0) is Outcome.APPLIED
    assert room.transition(RoomState.TRANSFERRING, 2.0) is Outcome.APPLIED
    assert room.fail(FailureCause.CLIENT_DISCONNECT, 3.0) is Outcome.APPLIED
    assert room.transition(RoomState.TRANSFERRING, 4.0) is Outcome.IGNORED_TERMINAL
    assert room.transition(RoomState.SUCCESS, 5.0) is Outcome.IGNORED_TERMINAL
    assert room.fail(FailureCause.DEADLINE, 6.0) is Outcome.IGNORED_TERMINAL
    assert room.state is RoomState.FAILED
    assert room.failure_cause is FailureCause.CLIENT_DISCONNECT
    assert room.last_progress_at == 3.0


def test_success_absorbs_failure() -> None:
    room = Room(KEY, deadline=100.0, now=0.0)
    room.transition(RoomState.SUCCESS, 1.0)
    assert room.fail(FailureCause.PEER_LOST, 2.0) is Outcome.IGNORED_TERMINAL
    assert room.state is RoomState.SUCCESS and room.failure_cause is None


def test_backward_refused_and_skip_forward_allowed() -> None:
    room = Room(KEY, deadline=100.0, now=0.0)
    assert room.transition(RoomState.TRANSFERRING, 1.0) is Outcome.APPLIED
    assert room.transition(RoomState.BOOTSTRAPPING, 2.0) is Outcome.REFUSED_BACKWARD
    assert room.transition(RoomState.WAITING_FOR_INPUT, 2.0) is Outcome.REFUSED_BACKWARD
    assert room.state is RoomState.TRANSFERRING


def test_cause_required_only_for_failed() -> None:
    room = Room(KEY, deadline=100.0, now=0.0)
    try:
        room.transition(RoomState.FAILED, 1.0)
    except ValueError:
        pass
    else:
        raise AssertionError("FAILED without a cause must be refused")
    try:
        room.transition(RoomState.SUCCESS, 1.0, cause=FailureCause.INTERNAL)
    except ValueError:
        pass
    else:
        raise AssertionError("a cause on SUCCESS must be refused")
    assert room.state is RoomState.BOOTSTRAPPING


def test_proto_numbers_are_stable() -> None:
    expected = {
        RoomState.BOOTSTRAPPING: 1,
        RoomState.WAITING_FOR_INPUT: 2,
        RoomState.TRANSFERRING: 3,
        RoomState.SUCCESS: 4,
        RoomState.FAILED: 5,
    }
    assert {s: s.proto for s in RoomState} == expected
    assert all(RoomState.from_proto(n) is s for s, n in expected.items())
