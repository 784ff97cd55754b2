"""Spans that end whatever happens, and say so when the request was aborted.

OTel skips BaseException when recording (opentelemetry-python#4484): a span ended by a
cancellation would look successful. `span` records the cancellation itself, and
`mark_aborted` sets the attributes operators filter on (docs/operations.md, Traces).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

ABORT_REASON = "pdmesh.abort.reason"
ABORT_STAGE = "pdmesh.abort.stage"
REASONS = ("client_disconnect", "deadline", "peer_lost", "rejected", "shutdown", "internal")
STAGES = ("queued", "prefill", "transfer", "decode")


@contextmanager
def span(
    name: str, *, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
    attributes: dict | None = None, tracer: str = "pdmesh",
) -> Iterator[Span]:
    """A span ended in `finally`; a cancellation or error ends it with status ERROR."""
    current = trace.get_tracer(tracer).start_span(
        name, context=context, kind=kind, attributes=attributes
    )
    try:
        with trace.use_span(current, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            yield current
    except asyncio.CancelledError:  # what anyio cancels with on asyncio (our only loop)
        if _status_unset(current):
            current.set_status(Status(StatusCode.ERROR, "cancelled"))
        current.add_event("cancelled")
        raise
    except BaseException as e:
        if _status_unset(current):
            current.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        current.record_exception(e)
        raise
    finally:
        current.end()


def _status_unset(target: Span) -> bool:
    """No status set yet. A non-recording span (tracing not set up) has no `status`
    attribute at all, and its set_status is a no-op: treat it as unset."""
    status = getattr(target, "status", None)
    return status is None or status.status_code is StatusCode.UNSET


def mark_aborted(target: Span, reason: str, stage: str) -> None:
    """An aborted request's span: status ERROR with the reason and the stage it was in."""
    reason = {"transfer_error": "peer_lost"}.get(reason, reason)  # a failed write: its peer
    if reason not in REASONS:
        reason = "internal"
    target.set_attribute(ABORT_REASON, reason)
    target.set_attribute(ABORT_STAGE, stage if stage in STAGES else "queued")
    target.set_status(Status(StatusCode.ERROR, f"aborted: {reason} during {stage}"))
