"""Count the spans a process ended but never delivered.

Tracing must never slow serving, so the batch queue is bounded and a slow or dead
collector loses spans. Lost silently, that would hide exactly the traces an operator
looks for; so every loss is counted, by cause, and each service shows the counts as
`pdmesh_trace_spans_dropped_total{cause}` on its metrics endpoint.

The stock BatchSpanProcessor drops the oldest queued span when its queue is full and
says so only in a log line. The accounting here needs no private state: every ended
span is either still queued, handed to the exporter, or dropped by the queue, so a span
that ends while `ended - handed - dropped` already equals the queue's size pushes one out.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

QUEUE_FULL = "queue_full"
EXPORT_FAILED = "export_failed"


class SpanLoss:
    """Thread-safe counts: spans end on the event loop and the compute threads, and are
    exported on the processor's worker thread."""

    def __init__(self, queue_size: int):
        self.queue_size = queue_size
        self._lock = threading.Lock()
        self.ended = 0
        self.handed = 0  # given to the exporter, whatever it made of them
        self.queue_full = 0
        self.export_failed = 0

    def span_ended(self) -> None:
        with self._lock:
            if self.ended - self.handed - self.queue_full >= self.queue_size:
                self.queue_full += 1
            self.ended += 1

    def handed_over(self, count: int) -> None:
        """Out of the queue, into an export (counted before it returns: exports can hang)."""
        with self._lock:
            self.handed += count

    def failed(self, count: int) -> None:
        with self._lock:
            self.export_failed += count

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return {QUEUE_FULL: self.queue_full, EXPORT_FAILED: self.export_failed}


class CountingExporter(SpanExporter):
    """Passes spans to the real exporter and counts those it failed to deliver."""

    def __init__(self, inner: SpanExporter, loss: SpanLoss):
        self.inner = inner
        self.loss = loss

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.loss.handed_over(len(spans))
        try:
            result = self.inner.export(spans)
        except Exception:
            self.loss.failed(len(spans))
            raise
        if result is not SpanExportResult.SUCCESS:
            self.loss.failed(len(spans))
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        # The batch processor hands its remaining time to exporters that take it.
        if "timeout_millis" in inspect.signature(self.inner.shutdown).parameters:
            self.inner.shutdown(timeout_millis=timeout_millis)
        else:
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingBatchProcessor(BatchSpanProcessor):
    """The stock bounded batch processor, with its queue drops counted."""

    def __init__(self, exporter: SpanExporter, loss: SpanLoss, **kwargs):
        super().__init__(CountingExporter(exporter, loss), max_queue_size=loss.queue_size,
                         **kwargs)
        self.loss = loss

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.loss.span_ended()
        super().on_end(span)
