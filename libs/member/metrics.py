"""Prometheus metrics of a prefill or decode.

Gauges and counters are read from the member's live Stats at scrape time, so they are
the numbers `pdmesh status` shows; the transfer histograms are observed by the prefill
as each room's KV lands. Labels carry service, role and name, never a request id.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from libs.kvpoll import RoomState
from libs.tracing.metrics import SpanLossCollector
from pdmesh.v1 import common_pb2 as cpb

PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BYTES_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB .. 4 GiB
DESCRIPTOR_BUCKETS = tuple(float(4**k) for k in range(0, 7))  # 1 .. 4096
GBPS_BUCKETS = (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000)


class MemberMetrics:
    def __init__(self, role: str, name: str, stats: Callable[[], cpb.MemberStats]):
        self.registry = CollectorRegistry()
        self.labels = labels = {"service": role, "role": role, "name": name}
        self.registry.register(_StatsCollector(labels, stats))
        self.registry.register(SpanLossCollector(labels))
        self.transfer_seconds = Histogram(
            "pdmesh_kv_transfer_seconds", "A room's KV transfer, first chunk to KvReady",
            list(labels), buckets=SECONDS_BUCKETS, registry=self.registry,
        ).labels(**labels)
        transfer_bytes = Histogram(
            "pdmesh_kv_transfer_bytes", "Bytes of one room's KV: kind=moved (written to "
            "the decode) or skipped (the decode held those pages already)",
            [*labels, "kind"], buckets=BYTES_BUCKETS, registry=self.registry,
        )
        self.transfer_bytes = transfer_bytes.labels(**labels, kind="moved")
        self.transfer_bytes_skipped = transfer_bytes.labels(**labels, kind="skipped")
        self.transfer_descriptors = Histogram(
            "pdmesh_kv_transfer_descriptors", "NIXL descriptors of one room's KV writes",
            list(labels), buckets=DESCRIPTOR_BUCKETS, registry=self.registry,
        ).labels(**labels)
        self.transfer_gbps = Histogram(
            "pdmesh_kv_transfer_gbps", "GB/s of a room's last KV write, post to done",
            list(labels), buckets=GBPS_BUCKETS, registry=self.registry,
        ).labels(**labels)
        self.transfer_tail_seconds = Histogram(
            "pdmesh_kv_transfer_tail_seconds", "A room's KV transfer after its last chunk "
            "was computed: staging (NVFP4 quantize), writes still in flight, the notifying "
            "write; with one chunk, the whole transfer", list(labels),
            buckets=SECONDS_BUCKETS, registry=self.registry,
        ).labels(**labels)

        if role == "decode":  # the decode streams the tokens: it sees both latencies
            self.ttft = Histogram(
                "pdmesh_time_to_first_token_seconds",
                "From the decode's Generate call to its first token (includes the prefill)",
                list(labels), buckets=LATENCY_BUCKETS, registry=self.registry,
            ).labels(**labels)
            self.itl = Histogram(
                "pdmesh_inter_token_latency_seconds", "Between two streamed token chunks",
                list(labels), buckets=LATENCY_BUCKETS, registry=self.registry,
            ).labels(**labels)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def app(self) -> Starlette:
        return metrics_app(self.registry)


def metrics_app(registry: CollectorRegistry) -> Starlette:
    """GET /metrics: the registry in Prometheus text format (members and the bootstrap)."""

    async def metrics(request) -> Response:
        return Response(generate_latest(registry), media_type=PROMETHEUS_MEDIA_TYPE)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


class SecondsByPart:
    """Counters read at scrape time from a loop's running totals: how many times a piece
    of work ran (``{count}_total``) and the seconds it spent, by part
    (``{seconds}_total{part}``)."""

    def __init__(self, labels: dict[str, str], count: str, seconds: str, text: str,
                 read: Callable[[], tuple[int, dict[str, float]]]):
        self.labels, self.count, self.seconds, self.text, self.read = (
            labels, count, seconds, text, read)

    def collect(self):
        n, parts = self.read()
        names, values = list(self.labels), list(self.labels.values())
        count = CounterMetricFamily(self.count, f"{self.text}: how many", labels=names)
        count.add_metric(values, n)
        yield count
        seconds = CounterMetricFamily(self.seconds, f"{self.text}: seconds, by part",
                                      labels=[*names, "part"])
        for part, value in parts.items():
            seconds.add_metric([*values, part], value)
        yield seconds


class _StatsCollector:
    def __init__(self, labels: dict[str, str], stats: Callable[[], cpb.MemberStats]):
        self.labels = labels
        self.stats = stats

    def collect(self):
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(metric: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, text, labels=names)
            family.add_metric(values, value)
            return family

        def counter(metric: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, text, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("pdmesh_inflight_requests", "Requests or rooms not yet terminal", s.inflight)
        rooms = GaugeMetricFamily("pdmesh_rooms", "Rooms by state", labels=[*names, "state"])
        for state in RoomState:
            rooms.add_metric([*values, state.name.lower()], s.rooms.get(state.name.lower(), 0))
        yield rooms
        yield gauge("pdmesh_kv_pages_used", "KV pages held for requests", s.kv_pages_used)
        yield gauge("pdmesh_kv_pages_total", "KV pages in the pool", s.kv_pages_total)
        yield gauge("pdmesh_healthy", "1 while every loop makes progress", float(s.healthy))
        yield gauge("pdmesh_pinned_rooms", "Live rooms without progress past the threshold",
                    len(s.pinned))
        yield counter("pdmesh_transfer_failed", "KV transfers that failed",
                      s.transfer_failed_total)
        aborts = CounterMetricFamily("pdmesh_aborts", "Requests ended early, by reason",
                                     labels=[*names, "reason"])
        for reason, count in sorted(s.aborts_by_reason.items()):
            aborts.add_metric([*values, reason], count)
        yield aborts
        yield counter("pdmesh_room_deadline_expired", "Rooms failed by their deadline",
                      s.deadline_expired_total)
        yield counter("pdmesh_member_requests", "Requests received", s.requests_total)
        if s.role == cpb.DECODE:
            yield counter("pdmesh_preemptions", "Sequences preempted when the KV pool ran dry",
                          s.preemptions_total)
        if s.role == cpb.PREFILL:
            yield counter("pdmesh_prompt_tokens_computed", "Prompt tokens through the model",
                          s.prompt_tokens_computed_total)
        yield gauge("pdmesh_kv_pages_cached", "Cached KV pages no request holds",
                    s.kv_pages_cached)
        yield counter("pdmesh_prefix_cache_queries", "Prefix cache lookups",
                      s.prefix_cache_queries_total)
        yield counter("pdmesh_prefix_cache_query_tokens", "Prompt tokens looked up",
                      s.prefix_cache_query_tokens_total)
        yield counter("pdmesh_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_cache_hits_total)
