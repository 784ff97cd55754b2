"""The membership store: registrations with epochs and leases.

Kept behind this small class so the store can later move to etcd with leases
without touching the gRPC service. One event loop owns it: no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdmesh.v1 import bootstrap_pb2 as bpb

Listener = Callable[[bpb.MembershipEvent], None]


class StaleEpoch(Exception):
    """A KeepAlive or Deregister named an epoch that is no longer registered."""


class RegistryFull(Exception):
    """The bounded member table is full."""


@dataclass
class Lease:
    member: bpb.Member
    expires_at: float


@dataclass
class Registry:
    lease_seconds: float = 5.0
    max_members: int = 256
    clock: Callable[[], float] = time.monotonic
    _members: dict[str, Lease] = field(default_factory=dict)
    _listeners: list[Listener] = field(default_factory=list)
    # (JOINED|LEFT, reason) -> count, for the bootstrap's metrics
    events_total: dict[tuple[str, str], int] = field(default_factory=dict)
    # Epochs start from wall-clock nanoseconds so a restarted bootstrap never
    # hands out an epoch an old registration already had.
    _next_epoch: int = field(default_factory=time.time_ns)

    def register(self, member: bpb.Member) -> bpb.Member:
        """Admit a member under a fresh epoch; a same-name registration replaces the old one."""
        old = self._members.pop(member.name, None)
        if old is None and len(self._members) >= self.max_members:
            raise RegistryFull(f"registry holds {self.max_members} members")
        if old is not None:
            self._publish(bpb.MembershipEvent.LEFT, [old.member], "replaced by a new epoch")
        self._next_epoch += 1
        admitted = bpb.Member()
        admitted.CopyFrom(member)
        admitted.epoch = self._next_epoch
        self._members[member.name] = Lease(admitted, self.clock() + self.lease_seconds)
        self._publish(bpb.MembershipEvent.JOINED, [admitted], "registered")
        return admitted

    def keep_alive(self, name: str, epoch: int) -> None:
        lease = self._current(name, epoch)
        lease.expires_at = self.clock() + self.lease_seconds

    def deregister(self, name: str, epoch: int) -> None:
        lease = self._current(name, epoch)
        del self._members[name]
        self._publish(bpb.MembershipEvent.LEFT, [lease.member], "deregistered")

    def expire(self) -> list[bpb.Member]:
        """Drop every member whose lease ran out; each one leaves with reason lease_expired."""
        now = self.clock()
        gone = [lease.member for lease in self._members.values() if lease.expires_at <= now]
        for member in gone:
            del self._members[member.name]
            self._publish(bpb.MembershipEvent.LEFT, [member], "lease expired")
        return gone

    def members(self) -> list[bpb.Member]:
        return [lease.member for lease in self._members.values()]

    def watchers(self) -> int:
        return len(self._listeners)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Listen to membership events; returns the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _current(self, name: str, epoch: int) -> Lease:
        lease = self._members.get(name)
        if lease is None or lease.member.epoch != epoch:
            raise StaleEpoch(f"{name} epoch {epoch} is not registered")
        return lease

    def _publish(self, kind: int, members: list[bpb.Member], reason: str) -> None:
        event = bpb.MembershipEvent(kind=kind, members=members, reason=reason)
        counted = (bpb.MembershipEvent.Kind.Name(kind).lower(), reason)
        self.events_total[counted] = self.events_total.get(counted, 0) + len(members)
        for listener in list(self._listeners):
            listener(event)
