"""The queue between the batch loop and a sequence's stream reader."""

from __future__ import annotations

import anyio
import pytest

from services.decode.token_queue import TokenQueue


async def test_a_reader_takes_everything_put_since_its_last_take_and_ends_after_close():
    queue: TokenQueue[int] = TokenQueue()
    got: list[list[int]] = []

    async def reader():
        while True:
            await queue.wait()
            if queue.ended:
                return
            got.append(queue.take())

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0.01)  # the reader sleeps on an empty queue
        queue.put(1)
        await anyio.sleep(0.01)
        queue.put(2)
        queue.put(3)  # two puts before the reader runs: one take
        queue.close()
    assert got == [[1], [2, 3]]
    assert queue.ended and queue.take() == []


async def test_iteration_yields_every_item_in_order():
    queue: TokenQueue[int] = TokenQueue()
    for i in range(5):
        queue.put(i)
    queue.close()
    assert [i async for i in queue] == [0, 1, 2, 3, 4]


async def test_puts_after_the_reader_left_are_dropped_and_a_put_after_close_is_refused():
    queue: TokenQueue[int] = TokenQueue()
    with queue.reading():
        queue.put(1)
    queue.put(2)  # the reader is gone: the batch loop is not disturbed
    assert queue.take() == []
    queue.close()
    with pytest.raises(RuntimeError):
        queue.put(3)


async def test_a_waiting_reader_is_cancelled_cleanly():
    queue: TokenQueue[int] = TokenQueue()
    with anyio.move_on_after(0.02):
        await queue.wait()
    queue.put(7)  # the cancelled wait left nothing behind
    await queue.wait()
    assert queue.take() == [7]
