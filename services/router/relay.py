"""Relay a request's events to a writer that may fall behind it: whatever arrived while
one write was in progress goes out in the next one.

A client that reads slowly, or a busy loop, makes every write wait; reading the mesh only
between writes would leave its messages queued one token each. Here the events are read
by a task of their own (the pump) while the writer writes, so a writer that falls behind
finds several events waiting and writes them as one message.

The pump opens, iterates and closes the event chain itself (`aclosing`), so an attempt's
cleanup (its Aborts) runs in that one task, and `relay` returns only once it has: the task
group waits for the pump, also when the caller is cancelled. Exceptions of the chain or of
the writer reach the caller as they are, not wrapped in an ExceptionGroup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import anyio

E = TypeVar("E")

READ_AHEAD = 256  # events read from the mesh but not yet written; past it, the pump waits


async def relay(
    open_events: Callable[[], AsyncIterator[E]],
    write: Callable[[list[E]], Awaitable[None]],
    read_ahead: int = READ_AHEAD,
) -> None:
    """Write every event of `open_events()`, each call of `write` taking all that waited."""
    send, receive = anyio.create_memory_object_stream[E](read_ahead)
    failures: list[Exception] = []

    async def pump() -> None:
        async with send:
            try:
                async with aclosing(open_events()) as events:
                    async for event in events:
                        await send.send(event)
            except Exception as exc:  # the caller raises it, after writing what came before
                failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump)
        try:
            async with receive:
                async for event in receive:
                    await write([event, *_waiting(receive)])
        except Exception as exc:  # the writer failed: the pump is cancelled, its chain closed
            failures.insert(0, exc)
            tg.cancel_scope.cancel()
    if failures:
        raise failures[0]


def _waiting(receive: anyio.abc.ObjectReceiveStream[E]) -> list[E]:
    events = []
    while True:
        try:
            events.append(receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return events
