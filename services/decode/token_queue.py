"""One sequence's sampled tokens on their way from the batch loop to its stream's reader.

The batch loop puts a token into every running sequence's queue each step and must never
block doing so; the reader takes everything put since its last take, then sends it. An
anyio memory stream would do, but it is built for many producers and consumers: each
receive passes through the event loop once (a checkpoint) even when items are waiting,
and each wait makes a fresh event. At 128 sequences those costs are paid thousands of
times a second on the event loop the batch loop shares. Here a put is a list append,
a take swaps the list out, and only a reader that finds the queue empty makes an event
to sleep on.

One producer, one consumer, both on the event loop. ``close`` ends the queue after its
last item. Once the reader has left (``leave``, or the end of ``reading``), later puts
are dropped: the batch loop never fails a step because a request went away first.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class TokenQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: list[T] = []
        self._closed = False
        self._left = False
        self._ready: anyio.Event | None = None  # set when a sleeping reader has work

    def put(self, item: T) -> None:
        """Add an item (never blocks). Raises if the queue was closed."""
        if self._closed:
            raise RuntimeError("put on a closed token queue")
        if not self._left:
            self._items.append(item)
            self._wake()

    def close(self) -> None:
        """No more items: the reader ends after taking those already put."""
        self._closed = True
        self._wake()

    def take(self) -> list[T]:
        """Every item put since the last take (possibly none), without waiting."""
        items, self._items = self._items, []
        return items

    @property
    def ended(self) -> bool:
        """Closed, and every item taken."""
        return self._closed and not self._items

    async def wait(self) -> None:
        """Until an item is there to take or the queue is closed."""
        while not self._items and not self._closed:
            self._ready = anyio.Event()
            try:
                await self._ready.wait()
            finally:
                self._ready = None

    def leave(self) -> None:
        """The reader is gone: drop what is there and whatever comes."""
        self._left = True
        self._items.clear()

    @contextlib.contextmanager
    def reading(self) -> Iterator[TokenQueue[T]]:
        """The reader's scope: it leaves the queue on the way out, however it exits."""
        try:
            yield self
        finally:
            self.leave()

    async def __aiter__(self) -> AsyncIterator[T]:
        """Every item in order until the queue ends."""
        while True:
            await self.wait()
            if self.ended:
                return
            for item in self.take():
                yield item

    def _wake(self) -> None:
        if self._ready is not None:
            self._ready.set()
