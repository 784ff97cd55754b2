"""The router's admission queue alone (services/router/admission.py): FIFO turns, the
bound, the two budgets, a waiter cancelled while queued, the backoff."""

from __future__ import annotations

import time

import anyio
import pytest

from services.router.admission import (
    FIRST_BACKOFF,
    AdmissionQueue,
    QueueFull,
    QueueTimeout,
)

FAR = 60.0  # a deadline no test reaches


def far() -> float:
    return time.monotonic() + FAR


async def test_turns_go_in_arrival_order_and_only_to_the_head():
    depths: list[int] = []
    queue = AdmissionQueue(max_queue=8, timeout=FAR, on_depth=depths.append)
    tickets = [queue.join() for _ in range(3)]
    assert queue.busy() and queue.depth == 3 and depths == [1, 2, 3]
    turns: list[int] = []

    async def waiter(i: int) -> None:
        await queue.wait_turn(tickets[i], far())
        turns.append(i)

    async with anyio.create_task_group() as tg:
        for i in (2, 1, 0):  # started in reverse: the order comes from the queue
            tg.start_soon(waiter, i)
        await anyio.sleep(0.05)
        # the head came back after its backoff; the others wait for their turn
        assert turns == [0]
        queue.leave(tickets[0])  # its pages reserved: the next head tries at once
        await anyio.sleep(0.005)  # well under the backoff: woken, not timed
        assert turns == [0, 1]
        queue.leave(tickets[1])
        await anyio.sleep(0.005)
        assert turns == [0, 1, 2]
        queue.leave(tickets[2])
    assert queue.depth == 0 and not queue.busy() and depths[-1] == 0


async def test_capacity_freed_wakes_the_head_before_its_backoff():
    queue = AdmissionQueue(max_queue=4, timeout=FAR)
    head = queue.join()
    head.backoff = 10.0  # nothing but a capacity event can wake it in this test
    woke = anyio.Event()

    async def wait() -> None:
        await queue.wait_turn(head, far())
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.02)
        assert not woke.is_set()
        queue.capacity_freed()
        with anyio.fail_after(1):
            await woke.wait()
    assert head.backoff == FIRST_BACKOFF  # a capacity event resets the backoff


async def test_the_head_tries_again_on_a_doubling_backoff_without_capacity_events():
    queue = AdmissionQueue(max_queue=4, timeout=FAR)
    head = queue.join()
    t0 = time.monotonic()
    for _ in range(3):
        await queue.wait_turn(head, far())
    # 10 + 20 + 40 ms, and the next wait will be 80 ms
    assert time.monotonic() - t0 >= 0.07
    assert head.backoff == pytest.approx(8 * FIRST_BACKOFF)


async def test_a_full_queue_refuses_a_newcomer_at_once_but_keeps_a_returning_ticket():
    queue = AdmissionQueue(max_queue=2, timeout=FAR)
    first, second = queue.join(), queue.join()
    with pytest.raises(QueueFull) as refused:
        queue.join()
    assert refused.value.retry_after >= 1 and "2 requests waiting" in str(refused.value)
    assert queue.depth == 2  # the refusal added nothing
    # A request whose pages were reserved (it left) and whose prefill then refused comes
    # back at its own place, bound or not: it waited its turn already.
    queue.leave(first)
    queue.join()  # a newcomer takes the free place
    queue.join(first)
    assert queue.depth == 3
    assert [t.seq for t in queue._waiting] == [first.seq, second.seq, first.seq + 2]


@pytest.mark.parametrize("queue_timeout, deadline_in, by_deadline", [
    (FAR, 0.05, True),   # the request's own deadline comes first
    (0.05, FAR, False),  # the queue's timeout comes first
])
async def test_a_wait_ends_at_the_earlier_budget_and_says_which(
    queue_timeout, deadline_in, by_deadline
):
    queue = AdmissionQueue(max_queue=4, timeout=queue_timeout)
    head = queue.join()
    head.backoff = 10.0
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout) as ended:
        await queue.wait_turn(head, t0 + deadline_in)
    assert 0.04 <= time.monotonic() - t0 < 1.0
    assert ended.value.deadline is by_deadline
    queue.leave(head)
    assert queue.depth == 0


async def test_a_waiter_cancelled_while_queued_leaves_a_clean_queue_and_the_next_goes():
    queue = AdmissionQueue(max_queue=4, timeout=FAR)
    head, second = queue.join(), queue.join()
    head.backoff = 10.0
    second_turn = anyio.Event()

    async def client_that_leaves() -> None:
        try:
            await queue.wait_turn(head, far())
        finally:  # what MeshClient.generate does on its way out
            queue.leave(head)

    async def next_in_line() -> None:
        await queue.wait_turn(second, far())
        second_turn.set()

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as leaving:
            tg.start_soon(next_in_line)
            async with anyio.create_task_group() as inner:
                inner.start_soon(client_that_leaves)
                await anyio.sleep(0.02)
                leaving.cancel()
        assert queue.depth == 1 and queue._waiting[0] is second
        with anyio.fail_after(1):
            await second_turn.wait()  # the cancelled head's leave woke it
        queue.leave(second)
    assert queue.depth == 0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        AdmissionQueue(max_queue=0, timeout=1.0)
    with pytest.raises(ValueError):
        AdmissionQueue(max_queue=1, timeout=0.0)
