"""Install the process's tracer provider from the standard OTEL_* variables.

Export is OTLP over gRPC when an endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_TRACES_EXPORTER=otlp), `console` prints spans,
and `none` (or nothing configured) records nothing. The batch queue is bounded: a slow or
unreachable collector loses spans, it never slows or blocks serving.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

from libs.tracing.loss import CountingBatchProcessor, SpanLoss

QUEUE_SPANS = 4096
EXPORT_TIMEOUT_MS = 2000


def exporter_from_env(env: dict[str, str] | None = None) -> SpanExporter | None:
    env = os.environ if env is None else env
    choice = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or choice == "none":
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if choice == "otlp" or endpoint:
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if protocol != "grpc":
            raise ValueError(f"OTLP protocol {protocol!r}: pdmesh exports OTLP over gRPC only")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        from libs.rpc import tls

        # An https endpoint (the embedded trace store of a TLS mesh) is reached with this
        # process's certificate; an http one stays plaintext.
        config = tls.from_env(env)
        credentials = tls.channel_credentials(config) if config is not None else None
        return OTLPSpanExporter(timeout=EXPORT_TIMEOUT_MS / 1000, credentials=credentials)
    return None


def configure(default_service: str, env: dict[str, str] | None = None) -> TracerProvider:
    """Install and return the tracer provider; its service.name defaults to
    `default_service` unless OTEL_SERVICE_NAME says otherwise."""
    env = os.environ if env is None else env
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service}
    provider = TracerProvider(resource=Resource.create(attributes))
    exporter = exporter_from_env(env)
    if exporter is not None:
        loss = SpanLoss(QUEUE_SPANS)
        provider.add_span_processor(
            CountingBatchProcessor(exporter, loss, export_timeout_millis=EXPORT_TIMEOUT_MS)
        )
        provider.pdmesh_span_loss = loss  # read by dropped_spans() for the metrics
    trace.set_tracer_provider(provider)
    return provider


def dropped_spans() -> dict[str, int]:
    """Spans this process lost, by cause; empty when nothing is exported."""
    loss = getattr(trace.get_tracer_provider(), "pdmesh_span_loss", None)
    return loss.dropped() if loss is not None else {}
