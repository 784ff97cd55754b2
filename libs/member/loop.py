"""The one task that owns a member's compute thread, and how a wedged one is noticed.

Requests never call the engine themselves: they queue work and wait for its result, and
a single loop (the prefill's scheduler, the decode's batcher) takes what is queued, runs
it on the compute thread so the event loop never blocks on a forward pass, and hands the
results back. One owner means one pass at a time and no lock. The loop sleeps on an event
while nothing is queued, and records when it last made progress: queued work that sees
none for ``stall_after`` seconds is a stall, which turns the member's health
NOT_SERVING instead of leaving it silent.
"""

from __future__ import annotations

import time

import anyio


class ComputeLoop:
    """Base of a single-owner compute loop; ``busy`` says whether work is queued or running.

    A subclass's ``run`` is ``while True: await self.until_busy(); <one pass>`` and calls
    :meth:`progressed` when a pass ends.
    """

    def __init__(self, stall_after: float) -> None:
        self.stall_after = stall_after
        self.last_progress = time.monotonic()
        self._wake = anyio.Event()

    def busy(self) -> bool:
        raise NotImplementedError

    def wake(self) -> None:
        """Work was queued: the loop stops sleeping."""
        self._wake.set()

    async def until_busy(self) -> None:
        """Return once work is queued. Sleeping without work is not a stall, so the wait
        counts as progress."""
        while not self.busy():
            self._wake = anyio.Event()
            await self._wake.wait()
            self.progressed()

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def stalled(self, after: float | None = None) -> bool:
        """Work is queued or running but nothing progressed for ``after`` seconds (default
        ``stall_after``): a wedged loop or thread."""
        after = self.stall_after if after is None else after
        return self.busy() and time.monotonic() - self.last_progress > after
