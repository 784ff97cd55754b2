"""One admitted request on a member, and how it ends: the same on a prefill and a decode.

A :class:`Request` is what the lifecycle needs to know of a request on either member: its
room and pages, the cancel scope that an Abort, a lost peer or a deadline sweep cancels,
why and in which stage that happened, and the event its release sets. :class:`Lifecycle`
wraps the request's handler: it keeps the first cause the request failed for, fails the
room with it, counts and traces it, then runs the release shielded and bounded
(docs/design.md, trap 9): a cancelled handler still releases, and a release never hangs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from opentelemetry.trace import Span

from libs.kvpoll import FailureCause, Room, RoomKey, RoomState
from libs.member.stats import Counters
from libs.tracing import mark_aborted
from pdmesh.v1 import common_pb2 as cpb

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Request:
    """One admitted request on this member, until its release has run."""

    key: RoomKey
    room: Room
    pages: list[int]
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    abort_reason: FailureCause | None = None
    abort_stage: str = ""  # the request's stage as the Abort's sender saw it
    stage: str = "queued"  # for traces: queued | prefill | transfer | decode
    # Set once the release ran: no step or write of ours touches the pages any more, and
    # they are free, or kept (unfenced writes, a decode's quarantine) until fenced.
    released: anyio.Event = field(default_factory=anyio.Event)

    @property
    def peer_ref(self) -> cpb.PeerRef:
        """The member at the other end of this request."""
        raise NotImplementedError

    def cancel(self, reason: FailureCause, stage: str = "") -> None:
        """End the request from outside; the first reason (and the stage its sender saw)
        is the one its trace and counters report."""
        if self.abort_reason is None:
            self.abort_reason = reason
            self.abort_stage = stage
        self.scope.cancel()


class Lifecycle:
    """``async with`` around a request's handler: records why it failed, then releases.

    A handler that converts an exception into a typed status first records the cause
    with :meth:`fail`; an escaping cancellation means the caller left (or its deadline
    passed), anything else is ``internal``. On the way out the room fails with the first
    cause, which is counted and marked on ``span``, and ``release`` runs under a shield
    of ``bound`` seconds. ``release`` returns the name of the span event that says what
    became of the pages (``released`` or ``quarantined``).
    """

    def __init__(self, request: Request, counters: Counters, span: Span, *, deadline: float,
                 release: Callable[[], Awaitable[str]], bound: float) -> None:
        self.request = request
        self.counters = counters
        self.span = span
        self.deadline = deadline  # the call's: a cancellation after it is a deadline
        self.release = release
        self.bound = bound
        self.cause: FailureCause | None = None

    def fail(self, cause: FailureCause) -> FailureCause:
        """Record why the request ended early; the first cause wins."""
        if self.cause is None:
            self.cause = cause
        return self.cause

    def aborted(self) -> FailureCause | None:
        """Why the request was ended from outside, once its scope is left: the scope was
        cancelled or the room failed (an Abort, a lost peer, a deadline sweep)."""
        request = self.request
        if request.scope.cancelled_caught or request.room.state is RoomState.FAILED:
            return self.fail(
                request.abort_reason or request.room.failure_cause or FailureCause.INTERNAL
            )
        return None

    async def __aenter__(self) -> Lifecycle:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if issubclass(exc_type, anyio.get_cancelled_exc_class()):  # the caller left
                self.fail(self.counters.cancelled(self.deadline))
            else:
                self.fail(FailureCause.INTERNAL)
        request = self.request
        if self.cause is not None:
            request.room.fail(self.cause, time.monotonic())
            self.counters.aborts[self.cause.value] += 1  # once per request that ended early
            mark_aborted(self.span, self.cause.value, request.abort_stage or request.stage)
        outcome = "released"
        with anyio.move_on_after(self.bound, shield=True) as bounded:
            outcome = await self.release()
        if bounded.cancelled_caught:
            log.error("room %s: release cut short after %g s; its %d pages are kept",
                      request.key, self.bound, len(request.pages))
        self.span.add_event(outcome, {"pdmesh.kv.pages": len(request.pages)})
