"""`pdmesh_trace_spans_dropped_total{cause}` for a service's Prometheus registry."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily

from libs.tracing.loss import EXPORT_FAILED, QUEUE_FULL
from libs.tracing.setup import dropped_spans


class SpanLossCollector:
    """Reads the installed tracer provider's loss counts at scrape time."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels

    def collect(self):
        family = CounterMetricFamily(
            "pdmesh_trace_spans_dropped",
            "Spans ended but never delivered to the collector, by cause",
            labels=[*self.labels, "cause"],
        )
        dropped = dropped_spans()
        for cause in (QUEUE_FULL, EXPORT_FAILED):
            family.add_metric([*self.labels.values(), cause], dropped.get(cause, 0))
        yield family
