"""Spans lost to a full queue or a failed export are counted, never silently gone."""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from libs.tracing.loss import EXPORT_FAILED, QUEUE_FULL, CountingBatchProcessor, SpanLoss


class StuckExporter(SpanExporter):
    """A collector that hangs on its first export until released, then takes everything."""

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()
        self.received = 0

    def export(self, spans):
        self.entered.set()
        self.release.wait(10)
        self.received += len(spans)
        return SpanExportResult.SUCCESS


class RefusingExporter(SpanExporter):
    def __init__(self, raises: bool = False):
        self.raises = raises

    def export(self, spans):
        if self.raises:
            raise ConnectionError("collector gone")
        return SpanExportResult.FAILURE


def _provider(exporter: SpanExporter, queue: int, batch: int) -> tuple[TracerProvider, SpanLoss]:
    loss = SpanLoss(queue)
    provider = TracerProvider()
    provider.add_span_processor(CountingBatchProcessor(
        exporter, loss, max_export_batch_size=batch, schedule_delay_millis=10))
    return provider, loss


def test_a_full_queue_counts_every_span_it_pushed_out():
    exporter = StuckExporter()
    provider, loss = _provider(exporter, queue=8, batch=4)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("first"):
        pass
    assert exporter.entered.wait(5)  # the worker holds 1 span inside the stuck export
    for i in range(50):
        with tracer.start_as_current_span(f"s{i}"):
            pass
    assert loss.dropped() == {QUEUE_FULL: 50 - 8, EXPORT_FAILED: 0}
    exporter.release.set()
    provider.shutdown()
    assert exporter.received == 1 + 8  # what the counts say survived, arrived
    assert loss.ended == 51 and loss.handed == 9


def test_failed_exports_count_their_spans():
    for raises in (False, True):
        provider, loss = _provider(RefusingExporter(raises), queue=64, batch=4)
        tracer = provider.get_tracer("t")
        for i in range(10):
            with tracer.start_as_current_span(f"s{i}"):
                pass
        provider.shutdown()
        assert loss.dropped() == {QUEUE_FULL: 0, EXPORT_FAILED: 10}, raises


def test_nothing_is_counted_lost_when_the_collector_keeps_up():
    exporter = StuckExporter()
    exporter.release.set()
    provider, loss = _provider(exporter, queue=16, batch=4)
    tracer = provider.get_tracer("t")
    for i in range(100):
        with tracer.start_as_current_span(f"s{i}"):
            pass
        if i % 8 == 7:
            provider.force_flush()
    provider.shutdown()
    assert loss.dropped() == {QUEUE_FULL: 0, EXPORT_FAILED: 0}
    assert exporter.received == 100
