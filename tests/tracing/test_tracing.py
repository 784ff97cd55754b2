"""libs/tracing without a mesh: spans end and say why, context crosses gRPC metadata."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from libs.tracing import (
    ABORT_REASON,
    ABORT_STAGE,
    incoming_context,
    mark_aborted,
    outgoing_metadata,
    span,
)
from libs.tracing.setup import exporter_from_env


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process; later calls are ignored
    yield exporter


def _named(exporter: InMemorySpanExporter, name: str):
    return next(s for s in exporter.get_finished_spans() if s.name == name)


async def test_a_span_ended_by_cancellation_is_an_error_not_a_success(spans):
    with anyio.move_on_after(0.01):
        with span("cancelled-work"):
            await anyio.sleep(1)
    ended = _named(spans, "cancelled-work")
    assert ended.status.status_code is StatusCode.ERROR
    assert [e.name for e in ended.events] == ["cancelled"]


def test_an_aborted_span_carries_reason_and_stage(spans):
    with span("aborted-request") as current:
        mark_aborted(current, "client_disconnect", "transfer")
    ended = _named(spans, "aborted-request")
    assert ended.status.status_code is StatusCode.ERROR
    assert ended.attributes[ABORT_REASON] == "client_disconnect"
    assert ended.attributes[ABORT_STAGE] == "transfer"
    with span("odd-abort") as current:
        mark_aborted(current, "made-up", "nowhere")
    odd = _named(spans, "odd-abort")
    assert (odd.attributes[ABORT_REASON], odd.attributes[ABORT_STAGE]) == ("internal", "queued")


def test_a_normal_span_is_unset_and_an_error_records_it(spans):
    with span("fine"):
        pass
    assert _named(spans, "fine").status.status_code is StatusCode.UNSET
    with pytest.raises(ValueError), span("broken"):
        raise ValueError("boom")
    broken = _named(spans, "broken")
    assert broken.status.status_code is StatusCode.ERROR and "boom" in broken.status.description


class _Context:
    """What a handler's ServicerContext offers for metadata."""

    def __init__(self, metadata):
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_trace_context_crosses_grpc_metadata(spans):
    with span("client-side") as parent:
        metadata = outgoing_metadata((("x-other", "1"),))
    keys = [k for k, _ in metadata]
    assert "traceparent" in keys and "x-other" in keys
    with span("server-side", context=incoming_context(_Context(metadata))):
        pass
    child = _named(spans, "server-side")
    assert child.context.trace_id == parent.get_span_context().trace_id
    assert child.parent.span_id == parent.get_span_context().span_id
    with span("orphan", context=incoming_context(_Context(None))):
        pass
    assert _named(spans, "orphan").parent is None


def test_exporter_choice_follows_the_standard_variables():
    assert exporter_from_env({}) is None
    assert exporter_from_env({"OTEL_TRACES_EXPORTER": "none",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"}) is None
    assert type(exporter_from_env({"OTEL_TRACES_EXPORTER": "console"})).__name__ == \
        "ConsoleSpanExporter"
    with pytest.raises(ValueError, match="gRPC only"):
        exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


@pytest.mark.parametrize("error", [ValueError("bad"), GeneratorExit(), asyncio.CancelledError()])
def test_a_span_without_an_sdk_lets_the_real_error_through(monkeypatch, error):
    """Tracing not set up: spans are non-recording and have no `status`; the error that
    ended the block must come out, not an AttributeError from the span's bookkeeping."""
    monkeypatch.setattr(trace, "get_tracer", lambda *a, **k: trace.NoOpTracer())
    with pytest.raises(type(error)):
        with span("untraced"):
            raise error
