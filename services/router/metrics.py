"""The router's Prometheus metrics (names start with pdmesh_; labels never carry a request id)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from libs.tracing.metrics import SpanLossCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, name: str):
        self.registry = CollectorRegistry()
        labels = {"service": "router", "role": "router", "name": name}
        self._labels = labels
        names = list(labels)
        self.registry.register(SpanLossCollector(labels))
        self.inflight = Gauge(
            "pdmesh_inflight_requests", "Requests not yet finished", names, registry=self.registry
        ).labels(**labels)
        self.requests = Counter(
            "pdmesh_requests", "Requests by outcome", [*names, "outcome"], registry=self.registry
        )
        self.aborts = Counter(
            "pdmesh_aborts",
            "Aborted requests by reason",
            [*names, "reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pdmesh_retries",
            "Attempts retried after failing UNAVAILABLE before their first token",
            names,
            registry=self.registry,
        ).labels(**labels)
        self.reruns = Counter(
            "pdmesh_preempted_reruns",
            "Preempted requests continued on a pair with room",
            names,
            registry=self.registry,
        ).labels(**labels)
        self.ttft = Histogram(
            "pdmesh_time_to_first_token_seconds",
            "Time to first token",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.itl = Histogram(
            "pdmesh_inter_token_latency_seconds",
            "Time between output chunks",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

        self.queue_depth = Gauge(
            "pdmesh_queue_depth", "Requests waiting in the admission queue", names,
            registry=self.registry,
        ).labels(**labels)
        self.queue_time = Histogram(
            "pdmesh_queue_time_seconds",
            "Time a request spent in the admission queue, from joining it to its pages' "
            "reservation or to leaving (0 for a request that never waited)",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def retry(self) -> None:
        self.retries.inc()

    def rerun(self) -> None:
        self.reruns.inc()

    def abort(self, reason: str) -> None:
        self.aborts.labels(**self._labels, reason=reason).inc()

    def text(self) -> str:
        return generate_latest(self.registry).decode()
