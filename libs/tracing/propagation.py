"""W3C trace context (`traceparent`, `tracestate`) in gRPC metadata, both ways."""

from __future__ import annotations

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace


def outgoing_metadata(
    extra: tuple[tuple[str, str], ...] = (), span: trace.Span | None = None,
) -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call: `span`'s context (default the current one), plus
    `extra`."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span else None)
    return tuple(carrier.items()) + tuple(extra)


def incoming_context(context: grpc.aio.ServicerContext) -> otel_context.Context:
    """The caller's trace context from a handler's invocation metadata (empty if none)."""
    carrier = {key: value for key, value in (context.invocation_metadata() or ())
               if isinstance(value, str)}
    return propagate.extract(carrier)
