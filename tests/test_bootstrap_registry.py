"""The registry alone: epochs, leases, replacement and events (a fake clock)."""

from __future__ import annotations

import pytest

from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from services.bootstrap.registry import Registry, RegistryFull, StaleEpoch


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def member(name="decode-0"):
    return bpb.Member(role=cpb.DECODE, name=name, address="127.0.0.1:1")


def test_reregistration_gets_a_new_epoch_and_announces_the_old_one_left():
    registry = Registry(lease_seconds=5, clock=Clock())
    events = []
    registry.subscribe(events.append)
    first = registry.register(member())
    second = registry.register(member())
    assert second.epoch > first.epoch
    kinds = [(e.kind, e.members[0].epoch) for e in events]
    assert kinds == [
        (bpb.MembershipEvent.JOINED, first.epoch),
        (bpb.MembershipEvent.LEFT, first.epoch),
        (bpb.MembershipEvent.JOINED, second.epoch),
    ]
    with pytest.raises(StaleEpoch):
        registry.keep_alive("decode-0", first.epoch)
    registry.keep_alive("decode-0", second.epoch)


def test_lease_expiry_removes_a_silent_member():
    clock = Clock()
    registry = Registry(lease_seconds=5, clock=clock)
    quiet = registry.register(member("quiet"))
    alive = registry.register(member("alive"))
    clock.now = 4
    registry.keep_alive("alive", alive.epoch)
    clock.now = 6
    gone = registry.expire()
    assert [m.name for m in gone] == ["quiet"]
    assert [m.name for m in registry.members()] == ["alive"]
    with pytest.raises(StaleEpoch):
        registry.keep_alive("quiet", quiet.epoch)


def test_registry_is_bounded():
    registry = Registry(max_members=2, clock=Clock())
    registry.register(member("a"))
    registry.register(member("b"))
    with pytest.raises(RegistryFull):
        registry.register(member("c"))
    registry.register(member("a"))  # replacing an existing name is fine


def test_epochs_never_repeat_across_registry_restarts():
    a = Registry(clock=Clock()).register(member())
    b = Registry(clock=Clock()).register(member())
    assert b.epoch > a.epoch
