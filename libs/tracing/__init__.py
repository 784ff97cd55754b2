"""OpenTelemetry for every pdmesh service.

Configured by the standard OTEL_* variables. W3C trace context travels in gRPC metadata
through the thin helpers here, not the stock grpc.aio instrumentation: its client side
awaits the call's status, which ignores cancellation, and its server side records
cancelled RPCs as successful (docs/design.md, "grpc.aio and anyio traps", 4 and 5).
"""

from libs.tracing.propagation import incoming_context, outgoing_metadata
from libs.tracing.setup import configure, dropped_spans
from libs.tracing.spans import ABORT_REASON, ABORT_STAGE, mark_aborted, span

__all__ = [
    "ABORT_REASON",
    "ABORT_STAGE",
    "configure",
    "dropped_spans",
    "incoming_context",
    "mark_aborted",
    "outgoing_metadata",
    "span",
]
