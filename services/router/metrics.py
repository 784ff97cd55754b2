"""The router's Prometheus metrics (names start with pdmesh_; labels never carry a request id)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

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

        self.kv_routes = Counter(
            "pdmesh_kv_routes",
            "Pair choices by where the prompt's cached KV was: landed (on the prefill and "
            "decode holding the most of it), elsewhere, cold (no member held any)",
            [*names, "outcome"], registry=self.registry,
        )
        self.kv_events_ignored = Counter(
            "pdmesh_kv_events_ignored",
            "Members' cache events ignored: of another epoch than the one paired with, of "
            "another model, or of an unknown kind",
            [*names, "reason"], registry=self.registry,
        )

    def watch_view(self, view) -> None:
        """Export the size of the router's view of each member's prefix cache
        (services/router/kv_view.py): once converged it equals the member's cached pages."""
        self.registry.register(_ViewCollector(self._labels, view))

    def kv_route(self, outcome: str) -> None:
        self.kv_routes.labels(**self._labels, outcome=outcome).inc()

    def kv_event_ignored(self, reason: str) -> None:
        self.kv_events_ignored.labels(**self._labels, reason=reason).inc()

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


class _ViewCollector:
    def __init__(self, labels: dict[str, str], view) -> None:
        self.labels = labels
        self.view = view

    def collect(self):
        family = GaugeMetricFamily(
            "pdmesh_kv_view_pages", "Prefix-cache pages the router knows a member holds "
            "(from its cache events)", labels=[*self.labels, "member"])
        for member, seen in list(self.view.members.items()):
            family.add_metric([*self.labels.values(), member], len(seen.keys))
        yield family
