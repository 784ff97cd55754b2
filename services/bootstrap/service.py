"""The Bootstrap gRPC service: Register, KeepAlive, Deregister, Watch, ListMembers."""

from __future__ import annotations

import math

import anyio
import grpc

from libs.rpc import tls
from libs.rpc.handlers import RpcError, contained, invalid
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb
from services.bootstrap.registry import Registry, RegistryFull, StaleEpoch
from services.bootstrap.store import MembershipStore, MemoryStore, StoreUnavailable

WATCH_QUEUE = 1024


def _check_member(member: bpb.Member) -> None:
    if not member.name or len(member.name) > 128:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "member.name must be 1..128 chars")
    if member.role not in (cpb.PREFILL, cpb.DECODE, cpb.ROUTER):
        raise invalid("member.role must be prefill|decode|router")
    if not member.address:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "member.address is required")
    if member.role in (cpb.PREFILL, cpb.DECODE):
        layout = member.layout
        if (not member.nixl_metadata or not layout.model or layout.page_bytes == 0
                or layout.wire_page_bytes == 0 or not layout.transfer_format):
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "prefill/decode members must carry nixl_metadata and a KV layout "
                "(with its transfer format and wire page size)",
            )


def _check_identity(role: int, context) -> None:
    """Over TLS a member is registered, kept alive or removed only from a certificate of
    its role (libs.rpc.tls): a client's or a router's certificate cannot join as a decode,
    nor a prefill's take over a decode's name. Checked before the registry is touched, so a
    refusal leaves no state."""
    if tls.from_env() is None:
        return  # a plaintext bootstrap (`pdmesh up --insecure`) has no identities to check
    peer = tls.peer_role(context)
    wanted = cpb.Role.Name(role).lower()
    if peer != wanted:
        raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                       f"only a {wanted} certificate may register, renew or remove a {wanted}; "
                       f"the caller's certificate names role {peer or 'none'}")


class BootstrapService(bgrpc.BootstrapServicer):
    def __init__(self, store: MembershipStore | Registry):
        if isinstance(store, Registry):
            store = MemoryStore(store, lease_period(store.lease_seconds))
        self.registry = store

    @contained
    async def Register(self, request, context):
        _check_member(request.member)
        _check_identity(request.member.role, context)
        await self._ready()
        self._check_owner(request.member.name, context)
        try:
            admitted = await self.registry.register(request.member)
        except RegistryFull as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        except StoreUnavailable as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        lease_ms = int(self.registry.lease_seconds * 1000)
        return bpb.RegisterReply(epoch=admitted.epoch, lease_ms=lease_ms)

    def _check_owner(self, name: str, context) -> None:
        """The member registered as `name` (if any) may be touched only by its own role."""
        for member in self.registry.members():
            if member.name == name:
                _check_identity(member.role, context)

    async def _ready(self) -> None:
        """The owner checks read the store's view: it must be current (etcd reachable)."""
        try:
            await self.registry.wait_ready()
        except StoreUnavailable as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e

    @contained
    async def KeepAlive(self, request, context):
        await self._ready()
        self._check_owner(request.member.name, context)
        try:
            await self.registry.keep_alive(request.member.name, request.member.epoch)
        except StaleEpoch as e:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(e)) from e
        except StoreUnavailable as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        return bpb.KeepAliveReply(lease_ms=int(self.registry.lease_seconds * 1000))

    @contained
    async def Deregister(self, request, context):
        await self._ready()
        self._check_owner(request.member.name, context)
        try:
            await self.registry.deregister(request.member.name, request.member.epoch)
        except StaleEpoch as e:
            raise RpcError(grpc.StatusCode.NOT_FOUND, str(e)) from e
        except StoreUnavailable as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        return bpb.DeregisterReply()

    @contained
    async def ListMembers(self, request, context):
        return bpb.ListMembersReply(members=self.registry.members())

    @contained
    async def Watch(self, request, context):
        """A snapshot first, then every change. A watcher too slow to keep up is cut off
        (RESOURCE_EXHAUSTED) rather than allowed to grow an unbounded queue."""
        send, receive = anyio.create_memory_object_stream[bpb.MembershipEvent](WATCH_QUEUE)
        overflowed = False

        def on_event(event: bpb.MembershipEvent) -> None:
            nonlocal overflowed
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                overflowed = True
                send.close()

        await self._ready()
        unsubscribe = self.registry.subscribe(on_event)
        try:
            snapshot = bpb.MembershipEvent(
                kind=bpb.MembershipEvent.SNAPSHOT, members=self.registry.members()
            )
            await context.write(snapshot)
            async with receive:
                async for event in receive:
                    await context.write(event)
            if overflowed:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "watcher fell behind")
        finally:
            unsubscribe()
            send.close()


def lease_period(lease_seconds: float) -> float:
    return max(0.05, min(1.0, lease_seconds / 5)) if math.isfinite(lease_seconds) else 1.0
