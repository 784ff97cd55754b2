"""The bootstrap's Prometheus metrics: who is registered, how membership changes, and
the spans this process could not deliver. Read from the registry at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette

from libs.member.metrics import metrics_app
from libs.tracing.metrics import SpanLossCollector
from pdmesh.v1 import common_pb2 as cpb
from services.bootstrap.store import MembershipStore

MEMBER_ROLES = (cpb.PREFILL, cpb.DECODE, cpb.ROUTER)


class BootstrapMetrics:
    def __init__(self, registry: MembershipStore):
        labels = {"service": "bootstrap", "role": "bootstrap", "name": "bootstrap"}
        self.prometheus = CollectorRegistry()
        self.prometheus.register(_RegistryCollector(labels, registry))
        self.prometheus.register(SpanLossCollector(labels))

    def app(self) -> Starlette:
        return metrics_app(self.prometheus)


class _RegistryCollector:
    def __init__(self, labels: dict[str, str], registry: MembershipStore):
        self.labels = labels
        self.registry = registry

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        members = GaugeMetricFamily("pdmesh_members", "Registered members by role",
                                    labels=[*names, "member_role"])
        live = self.registry.members()
        for role in MEMBER_ROLES:
            count = sum(1 for m in live if m.role == role)
            members.add_metric([*values, cpb.Role.Name(role).lower()], count)
        yield members
        events = CounterMetricFamily("pdmesh_membership_events",
                                     "Members that joined or left, by reason",
                                     labels=[*names, "kind", "reason"])
        for (kind, reason), count in sorted(self.registry.events_total.items()):
            events.add_metric([*values, kind, reason], count)
        yield events
        watchers = GaugeMetricFamily("pdmesh_membership_watchers", "Open Watch streams",
                                     labels=names)
        watchers.add_metric(values, self.registry.watchers())
        yield watchers
        foreign = CounterMetricFamily(
            "pdmesh_store_foreign_keys",
            "Keys under the store's members/ prefix that are not pdmesh registrations "
            "(ignored, never served)", labels=names)
        foreign.add_metric(values, self.registry.foreign_keys_total)
        yield foreign
        up = GaugeMetricFamily("pdmesh_store_up",
                               "1 while the membership store is reachable and the view current",
                               labels=names)
        up.add_metric(values, 1 if self.registry.connected else 0)
        yield up
