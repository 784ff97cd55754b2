"""The membership store seam: what the Bootstrap service needs from wherever members live.

Two stores stand behind it. `MemoryStore` (the default, `pdmesh up`) wraps the
in-process `Registry`: one bootstrap owns every lease, and a restart forgets them all.
`EtcdStore` (services.bootstrap.etcd_store) keeps registrations in etcd under leases,
so any number of bootstrap replicas serve the same mesh and none of them holds state.

The mutating calls are async (etcd is a round trip away); the reads are served from a
view the store keeps current, so a Watch's snapshot and the events that follow it come
from one ordered source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import anyio

from pdmesh.v1 import bootstrap_pb2 as bpb
from services.bootstrap.registry import Listener, Registry

DEFAULT_PREFIX = "/pdmesh/"


@dataclass(frozen=True)
class EtcdTarget:
    address: str  # host:port of an etcd client endpoint
    prefix: str

    @property
    def url(self) -> str:
        return f"etcd://{self.address}{self.prefix.rstrip('/')}"


def parse_store(text: str) -> EtcdTarget | None:
    """``memory`` -> None; ``etcd://HOST:PORT[/PREFIX]`` -> the target. Else ValueError."""
    if text == "memory":
        return None
    parts = urlsplit(text)
    if parts.scheme != "etcd" or not parts.hostname or not parts.port:
        raise ValueError(f"{text!r}: expected 'memory' or etcd://HOST:PORT[/PREFIX]")
    prefix = (parts.path.rstrip("/") or DEFAULT_PREFIX.rstrip("/")) + "/"
    return EtcdTarget(f"{parts.hostname}:{parts.port}", prefix)


class StoreUnavailable(Exception):
    """The backing store cannot be reached now; the caller may retry (gRPC UNAVAILABLE)."""


class MembershipStore(Protocol):
    lease_seconds: float
    # (joined|left, reason) -> members, for the bootstrap's metrics
    events_total: dict[tuple[str, str], int]

    async def register(self, member: bpb.Member) -> bpb.Member: ...

    async def keep_alive(self, name: str, epoch: int) -> None: ...

    async def deregister(self, name: str, epoch: int) -> None: ...

    def members(self) -> list[bpb.Member]: ...

    def watchers(self) -> int: ...

    def subscribe(self, listener: Listener) -> Callable[[], None]: ...

    async def wait_ready(self) -> None:
        """Until members() is current (StoreUnavailable if that does not come soon)."""
        ...

    async def close(self) -> None: ...

    async def run(self) -> None:
        """The store's background work (lease expiry, the etcd watch), forever."""
        ...


class MemoryStore:
    """The in-process registry behind the store interface: behaviour exactly as before."""

    foreign_keys_total = 0  # nobody else writes into this process's memory
    connected = True

    def __init__(self, registry: Registry, expiry_period: float):
        self.registry = registry
        self.expiry_period = expiry_period

    @property
    def lease_seconds(self) -> float:
        return self.registry.lease_seconds

    @property
    def events_total(self) -> dict[tuple[str, str], int]:
        return self.registry.events_total

    async def register(self, member: bpb.Member) -> bpb.Member:
        return self.registry.register(member)

    async def keep_alive(self, name: str, epoch: int) -> None:
        self.registry.keep_alive(name, epoch)

    async def deregister(self, name: str, epoch: int) -> None:
        self.registry.deregister(name, epoch)

    def members(self) -> list[bpb.Member]:
        return self.registry.members()

    def watchers(self) -> int:
        return self.registry.watchers()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        return self.registry.subscribe(listener)

    async def wait_ready(self) -> None:
        return

    async def close(self) -> None:
        return

    async def run(self) -> None:
        while True:
            self.registry.expire()
            await anyio.sleep(self.expiry_period)
