"""A member's side of the bootstrap: register, keep the lease alive, watch the mesh.

Every prefill, decode and router runs one of these inside its main task group.
The live member table is rebuilt from the Watch stream; listeners hear about
joins and departures so that, for example, a departed peer's NIXL agent is
dropped at once.

``address`` may name several bootstrap replicas (``host:port,host:port``, all serving
one etcd-backed store): a session that fails moves on to the next one. A reconnecting
member first renews its current epoch (KeepAlive) and registers anew only when the
bootstrap no longer knows it, so moving between replicas changes nothing its peers see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import grpc

from libs.rpc import tls
from libs.rpc.calls import open_channel, unary
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb

log = logging.getLogger(__name__)

JoinListener = Callable[[bpb.Member], None]
LeaveListener = Callable[[bpb.Member, str], None]


@dataclass
class Membership:
    """Register `me` with the bootstrap at `address` (one or several, comma-separated),
    then keep it registered."""

    address: str
    me: bpb.Member | None = None
    on_join: list[JoinListener] = field(default_factory=list)
    on_leave: list[LeaveListener] = field(default_factory=list)
    members: dict[str, bpb.Member] = field(default_factory=dict)
    epoch: int = 0
    lease_seconds: float = 5.0
    synced: anyio.Event = field(default_factory=anyio.Event)
    registered: anyio.Event = field(default_factory=anyio.Event)
    connected: bool = False

    def peers(self, role: int) -> list[bpb.Member]:
        return [m for m in self.members.values() if m.role == role]

    def ref(self) -> cpb.PeerRef:
        assert self.me is not None
        return cpb.PeerRef(name=self.me.name, epoch=self.epoch)

    async def run(self) -> None:
        """Run forever; fails over to the next bootstrap address, with backoff once all
        of them have failed in a row."""
        addresses = bootstrap_addresses(self.address)
        channels = [open_channel(address) for address in addresses]
        stubs = [bgrpc.BootstrapStub(channel) for channel in channels]
        current = 0
        try:
            backoff = 0.1
            failures = 0
            while True:
                try:
                    await self._session(stubs[current])
                except* grpc.aio.AioRpcError as group:
                    codes = {e.code().name for e in group.exceptions}
                    hint = f" ({tls.unavailable_hint()})" if "UNAVAILABLE" in codes else ""
                    log.warning("bootstrap %s: %s%s; retrying", addresses[current],
                                ", ".join(codes), hint)
                self.connected = False
                current = (current + 1) % len(stubs)
                failures += 1
                if failures % len(stubs) == 0:  # every replica failed once: wait, then again
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
        finally:
            with anyio.move_on_after(1.0, shield=True):
                for i in range(len(stubs)):  # the current replica first, then the others
                    if await self._deregister(stubs[(current + i) % len(stubs)]):
                        break
                for channel in channels:
                    await channel.close()

    async def _session(self, stub: bgrpc.BootstrapStub) -> None:
        if self.me is not None and not await self._renewed(stub):
            reply = await unary(stub.Register, bpb.RegisterRequest(member=self.me), timeout=5.0)
            self.epoch = reply.epoch
            self.me.epoch = reply.epoch
            self.lease_seconds = reply.lease_ms / 1000
            log.info("registered %s epoch %d", self.me.name, self.epoch)
            self.registered.set()
        self.connected = True
        async with anyio.create_task_group() as tg:
            if self.me is not None:
                tg.start_soon(self._keep_alive, stub)
            await self._watch(stub)
            tg.cancel_scope.cancel()

    async def _renewed(self, stub: bgrpc.BootstrapStub) -> bool:
        """Whether the registration this member already holds is still live (its lease just
        renewed); False when there is none or the bootstrap no longer knows it."""
        if not self.epoch:
            return False
        try:
            await unary(stub.KeepAlive, bpb.KeepAliveRequest(member=self.ref()),
                        timeout=max(0.5, self.lease_seconds / 2))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        log.info("%s kept epoch %d", self.me.name, self.epoch)
        return True

    async def _keep_alive(self, stub: bgrpc.BootstrapStub) -> None:
        while True:
            await anyio.sleep(self.lease_seconds / 4)
            await unary(
                stub.KeepAlive,
                bpb.KeepAliveRequest(member=self.ref()),
                timeout=max(0.5, self.lease_seconds / 2),
            )

    async def _watch(self, stub: bgrpc.BootstrapStub) -> None:
        call = stub.Watch(bpb.WatchRequest())
        try:
            async for event in call:
                self._apply(event)
        finally:
            call.cancel()

    def _apply(self, event: bpb.MembershipEvent) -> None:
        if event.kind == bpb.MembershipEvent.SNAPSHOT:
            fresh = {m.name: m for m in event.members}
            for name, old in list(self.members.items()):
                if name not in fresh or fresh[name].epoch != old.epoch:
                    del self.members[name]
                    self._left(old, "missing from snapshot")
            for member in fresh.values():
                if member.name not in self.members:
                    self._joined(member)
            self.synced.set()
        elif event.kind == bpb.MembershipEvent.JOINED:
            for member in event.members:
                old = self.members.get(member.name)
                if old is not None and old.epoch != member.epoch:
                    self._left(old, "replaced by a new epoch")
                self._joined(member)
        elif event.kind == bpb.MembershipEvent.LEFT:
            for member in event.members:
                old = self.members.get(member.name)
                if old is not None and old.epoch == member.epoch:
                    del self.members[member.name]
                    self._left(old, event.reason)

    def _joined(self, member: bpb.Member) -> None:
        self.members[member.name] = member
        for listener in self.on_join:
            _contained(listener, member)

    def _left(self, member: bpb.Member, reason: str) -> None:
        log.info("member %s epoch %d left: %s", member.name, member.epoch, reason)
        for listener in self.on_leave:
            _contained(listener, member, reason)

    async def _deregister(self, stub: bgrpc.BootstrapStub) -> bool:
        """Whether this replica answered (done, or nothing left to remove)."""
        if self.me is None or not self.epoch:
            return True
        try:
            await unary(stub.Deregister, bpb.DeregisterRequest(member=self.ref()), timeout=0.5)
        except grpc.aio.AioRpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
        return True


def bootstrap_addresses(text: str) -> list[str]:
    """`--bootstrap host:port[,host:port...]` as a list (at least one address)."""
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise ValueError(f"--bootstrap {text!r}: expected host:port[,host:port...]")
    return addresses


def bootstrap_flag(text: str) -> str:
    """argparse type of `--bootstrap`: every comma-separated part is host:port."""
    import argparse

    try:
        addresses = bootstrap_addresses(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{address!r} is not host:port")
    return text


def _contained(listener: Callable, *args) -> None:
    """A listener's bug must not kill the watch loop."""
    try:
        listener(*args)
    except Exception:
        log.exception("membership listener failed")
