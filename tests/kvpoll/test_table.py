"""RoomTable: bounds, duplicates, unknown keys, deadlines, bulk failure, ownership."""

from __future__ import annotations

import threading

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from libs.kvpoll import (
    DuplicateRoom,
    FailureCause,
    NotTerminal,
    Outcome,
    RoomKey,
    RoomState,
    RoomTable,
    TableFull,
    UnknownRoom,
    WrongThread,
)


def key(i: int, gen: int = 0) -> RoomKey:
    return RoomKey(i.to_bytes(16, "big"), gen)


def test_room_key_validates() -> None:
    with pytest.raises(ValueError):
        RoomKey(b"short", 0)
    with pytest.raises(ValueError):
        RoomKey(b"\x00" * 16, -1)


def test_duplicate_and_generation() -> None:
    table = RoomTable(4)
    table.create(key(1), deadline=10.0, now=0.0)
    with pytest.raises(DuplicateRoom):
        table.create(key(1), deadline=10.0, now=0.0)
    table.create(key(1, gen=1), deadline=10.0, now=0.0)  # new generation is a new room
    assert len(table) == 2


def test_bound_counts_terminal_until_removed() -> None:
    table = RoomTable(2)
    table.create(key(1), deadline=10.0, now=0.0)
    table.create(key(2), deadline=10.0, now=0.0)
    with pytest.raises(TableFull):
        table.create(key(3), deadline=10.0, now=0.0)
    with pytest.raises(NotTerminal):
        table.remove(key(1))
    table.fail(key(1), FailureCause.REJECTED, now=1.0)
    with pytest.raises(TableFull):
        table.create(key(3), deadline=10.0, now=0.0)
    table.remove(key(1))
    table.create(key(3), deadline=10.0, now=0.0)


def test_unknown_keys_never_create_state() -> None:
    table = RoomTable(2)
    with pytest.raises(UnknownRoom):
        table.get(key(9))
    with pytest.raises(UnknownRoom):
        table.transition(key(9), RoomState.SUCCESS, now=0.0)
    with pytest.raises(UnknownRoom):
        table.fail(key(9), FailureCause.INTERNAL, now=0.0)
    with pytest.raises(UnknownRoom):
        table.remove(key(9))
    assert len(table) == 0


def test_expire_fails_only_nonterminal_past_deadline() -> None:
    table = RoomTable(8)
    table.create(key(1), deadline=5.0, now=0.0)
    table.create(key(2), deadline=5.0, now=0.0)
    table.create(key(3), deadline=20.0, now=0.0)
    table.transition(key(2), RoomState.SUCCESS, now=4.0)  # drained before the sweep
    table.transition(key(3), RoomState.TRANSFERRING, now=1.0, deadline=6.0)  # new budget
    assert table.expire(4.9) == []
    assert table.expire(5.0) == [key(1)]
    assert table.get(key(1)).failure_cause is FailureCause.DEADLINE
    assert table.get(key(2)).state is RoomState.SUCCESS
    assert table.get(key(3)).state is RoomState.TRANSFERRING
    assert table.expire(6.0) == [key(3)]
    assert table.inflight == 0


def test_fail_where_fails_a_peer_at_once() -> None:
    table = RoomTable(8)
    for i in range(4):
        table.create(key(i), deadline=50.0, now=0.0)
    table.transition(key(0), RoomState.SUCCESS, now=1.0)
    dead = {key(0), key(1), key(2)}
    failed = table.fail_where(lambda r: r.key in dead, FailureCause.PEER_LOST, now=2.0)
    assert sorted(failed, key=lambda k: k.room) == [key(1), key(2)]
    assert table.get(key(0)).state is RoomState.SUCCESS
    assert table.get(key(3)).state is RoomState.BOOTSTRAPPING
    assert table.counts()[RoomState.FAILED] == 2
    assert table.inflight == 1


def test_writes_from_another_thread_are_refused() -> None:
    """The table has no lock by design; a stray worker thread fails loudly, changes nothing."""
    table = RoomTable(2)
    room = table.create(key(1), deadline=10.0, now=0.0)
    errors: list[BaseException] = []

    def worker() -> None:
        for _ in range(1000):
            try:
                room.transition(RoomState.TRANSFERRING, 1.0)
            except WrongThread as exc:
                errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4000
    assert room.state is RoomState.BOOTSTRAPPING


async def test_wait_terminal_wakes_on_failure() -> None:
    table = RoomTable(2)
    room = table.create(key(1), deadline=10.0)
    seen: list[RoomState] = []

    async def waiter() -> None:
        seen.append(await room.wait_terminal())

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.01)
            assert table.fail(key(1), FailureCause.SHUTDOWN) is Outcome.APPLIED
    assert seen == [RoomState.FAILED]
    assert await room.wait_terminal() is RoomState.FAILED


MAX = 6
keys = st.builds(key, st.integers(0, 7), st.integers(0, 1))
states = st.sampled_from(list(RoomState))
causes = st.sampled_from(list(FailureCause))


class TableMachine(RuleBasedStateMachine):
    """Random operations against a table with a shadow model of what must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.table = RoomTable(MAX)
        self.now = 0.0
        self.model: dict[RoomKey, tuple[RoomState, FailureCause | None]] = {}

    @rule(k=keys, budget=st.floats(0.5, 5.0))
    def create(self, k: RoomKey, budget: float) -> None:
        if k in self.model:
            with pytest.raises(DuplicateRoom):
                self.table.create(k, deadline=self.now + budget, now=self.now)
        elif len(self.model) >= MAX:
            with pytest.raises(TableFull):
                self.table.create(k, deadline=self.now + budget, now=self.now)
        else:
            self.table.create(k, deadline=self.now + budget, now=self.now)
            self.model[k] = (RoomState.BOOTSTRAPPING, None)

    @rule(k=keys, to=states, cause=causes)
    def transition(self, k: RoomKey, to: RoomState, cause: FailureCause) -> None:
        c = cause if to is RoomState.FAILED else None
        if k not in self.model:
            with pytest.raises(UnknownRoom):
                self.table.transition(k, to, self.now, cause=c)
            return
        before = self.model[k]
        outcome = self.table.transition(k, to, self.now, cause=c)
        room = self.table.get(k)
        if before[0].terminal:
            assert outcome is Outcome.IGNORED_TERMINAL
            assert (room.state, room.failure_cause) == before
        self.model[k] = (room.state, room.failure_cause)

    @rule(dt=st.floats(0.0, 3.0))
    def tick_and_expire(self, dt: float) -> None:
        self.now += dt
        expired = set(self.table.expire(self.now))
        for k in expired:
            assert not self.model[k][0].terminal
            self.model[k] = (RoomState.FAILED, FailureCause.DEADLINE)
        for room in self.table:
            assert room.terminal or room.deadline > self.now

    @rule(parity=st.integers(0, 1), cause=causes)
    def fail_where(self, parity: int, cause: FailureCause) -> None:
        hit = self.table.fail_where(lambda r: r.key.generation == parity, cause, self.now)
        for k in hit:
            assert not self.model[k][0].terminal
            self.model[k] = (RoomState.FAILED, cause)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from(sorted(self.model, key=lambda x: (x.room, x.generation))))
        if self.model[k][0].terminal:
            self.table.remove(k)
            del self.model[k]
        else:
            with pytest.raises(NotTerminal):
                self.table.remove(k)

    @invariant()
    def matches_model(self) -> None:
        assert len(self.table) == len(self.model) <= MAX
        for k, (state, cause) in self.model.items():
            room = self.table.get(k)
            assert (room.state, room.failure_cause) == (state, cause)

    @invariant()
    def counts_consistent(self) -> None:
        counts = self.table.counts()
        assert sum(counts.values()) == len(self.table)
        nonterminal = sum(n for s, n in counts.items() if not s.terminal)
        assert self.table.inflight == nonterminal
        assert nonterminal == sum(1 for s, _ in self.model.values() if not s.terminal)


TableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
test_table_machine = TableMachine.TestCase
