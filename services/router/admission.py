"""The router's admission queue: a request the mesh cannot place now waits here, in order.

A decode that cannot reserve a request's pages (or a prefill that cannot hold its
prompt) answers RESOURCE_EXHAUSTED at admission, and nothing of the request is left on
it. Rather than pass that refusal to the client, the router keeps the request in one
bounded queue, FIFO (one priority band today: the ordering key is `(band, seq)`, so a
band is a field away), and tries it again when capacity may have freed:

* only the head of the queue tries; everyone behind it waits, and a newcomer joins
  behind a non-empty queue instead of trying first, so a freed page goes to the request
  that waited longest, not to whoever asked last;
* the head tries again as soon as the router sees capacity come back (one of its own
  requests ended, or a prefill leg finished: `capacity_freed`), or, failing that, after
  a backoff (10 ms doubling to 0.5 s) that covers capacity this router cannot see (other
  routers' requests, a quarantine released by a fence, a member that joined);
* a head whose decode reserved its pages leaves the queue (`leave`), which lets the next
  head try at once: freed capacity may hold several waiting requests.

Only a full queue refuses at once (`QueueFull`: HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED). A wait ends at the request's own deadline (`deadline=True`: gRPC
DEADLINE_EXCEEDED, HTTP 504) or at the queue's timeout (HTTP 503, gRPC UNAVAILABLE),
whichever comes first. A cancelled wait (the client left) removes its ticket on the way
out: the request never reached a member while queued, so nothing else is left to undo.

Everything here runs on the router's one event loop and is synchronous between awaits:
no lock is needed.
"""

from __future__ import annotations

import itertools
import time
from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

FIRST_BACKOFF = 0.01  # seconds before a refused head tries again with no capacity seen
MAX_BACKOFF = 0.5
RETRY_AFTER = 1  # seconds a refused client is told to wait (the Retry-After header)


class QueueFull(Exception):
    """The queue holds `max_queue` requests already: refused at once."""

    def __init__(self, max_queue: int) -> None:
        super().__init__(f"the admission queue is full ({max_queue} requests waiting)")
        self.retry_after = RETRY_AFTER


class QueueTimeout(Exception):
    """A request waited in the queue until its budget ran out."""

    def __init__(self, waited: float, deadline: bool) -> None:
        why = "the request's deadline passed" if deadline else "the queue timeout passed"
        super().__init__(f"waited {waited:.1f} s in the admission queue; {why}")
        self.deadline = deadline  # the request's own deadline, not the queue's timeout
        self.retry_after = RETRY_AFTER


@dataclass(eq=False)
class Ticket:
    """One request's place in the queue, kept across its tries (its order never changes)."""

    seq: int
    band: int
    entered: float  # monotonic, when it first joined
    go: anyio.Event = field(default_factory=anyio.Event)  # try now
    backoff: float = FIRST_BACKOFF

    @property
    def order(self) -> tuple[int, int]:
        return (self.band, self.seq)


class AdmissionQueue:
    def __init__(self, max_queue: int, timeout: float,
                 on_depth: Callable[[int], None] = lambda depth: None) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if timeout <= 0:
            raise ValueError("the queue timeout must be positive")
        self.max_queue = max_queue
        self.timeout = timeout
        self.on_depth = on_depth
        self._waiting: list[Ticket] = []  # sorted by (band, seq): the head is [0]
        self._seq = itertools.count()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def busy(self) -> bool:
        """Someone waits: a newcomer must join behind them rather than try first."""
        return bool(self._waiting)

    def join(self, ticket: Ticket | None = None, band: int = 0) -> Ticket:
        """A new ticket (refused with QueueFull when the queue is full), or a ticket put
        back at its own place: a request whose decode reserved pages but whose prefill
        then refused keeps its turn, whatever the bound."""
        if ticket is None:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(self.max_queue)
            ticket = Ticket(next(self._seq), band, time.monotonic())
        if ticket not in self._waiting:
            insort(self._waiting, ticket, key=lambda t: t.order)
            self.on_depth(len(self._waiting))
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Out of the queue (its pages reserved, or it gave up); the next head tries now."""
        if ticket not in self._waiting:
            return
        was_head = self._waiting[0] is ticket
        self._waiting.remove(ticket)
        self.on_depth(len(self._waiting))
        if was_head and self._waiting:
            self._waiting[0].go.set()

    def capacity_freed(self) -> None:
        """Pages came back somewhere: the head tries again now."""
        if self._waiting:
            head = self._waiting[0]
            head.backoff = FIRST_BACKOFF
            head.go.set()

    async def wait_turn(self, ticket: Ticket, deadline: float) -> None:
        """Return when `ticket` should try: it is the head and capacity may have freed (or
        its backoff ran out). Raises QueueTimeout at the earlier of the request's
        `deadline` and the queue's timeout; the caller removes the ticket (`leave`)."""
        queue_deadline = ticket.entered + self.timeout
        while True:
            now = time.monotonic()
            end = min(deadline, queue_deadline)
            if now >= end:
                raise QueueTimeout(now - ticket.entered, deadline=deadline <= queue_deadline)
            head = self._waiting[0] is ticket
            wait = min(end - now, ticket.backoff) if head else end - now
            with anyio.move_on_after(wait):
                await ticket.go.wait()
            if ticket.go.is_set():
                ticket.go = anyio.Event()
                return
            if head and time.monotonic() < end:  # the backoff ran out: try anyway
                ticket.backoff = min(2 * ticket.backoff, MAX_BACKOFF)
                return
