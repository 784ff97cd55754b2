"""Membership in etcd v3: registrations under leases, so bootstrap replicas hold no state.

Layout under the prefix (default ``/pdmesh/``):

- ``members/<name>``: one registration, ``MAGIC`` + a serialized ``Member``, attached to
  an etcd lease of its own. Its **epoch is the key's mod_revision**: etcd's revision
  counter is cluster-wide and never repeats, so no two registrations ever share an epoch,
  whichever replica admitted them and however often replicas restart.
- ``left/<name>``: written in the same transaction that deletes a registration on
  Deregister, so a watcher tells "deregistered" from "lease expired" (a delete with no
  such write beside it is etcd revoking the lease).

Leases are etcd's: a KeepAlive through any replica renews the registration's lease, and
etcd's leader expires it. No wall clock of any host takes part, so clock skew between
hosts cannot evict or keep anyone.

Every replica keeps a view of ``members/`` from one List then one Watch from the next
revision, and fans the changes out to its own Watch streams; after any break (etcd
restarted, the watch compacted) it lists again and announces only the difference.

A key under ``members/`` that is not ours (no magic, a name that differs from the key,
no lease, a role or address a bootstrap would have refused) is ignored and counted in
``foreign_keys_total``; it never reaches a member.

The stubs come from ``aetcd`` (its etcd v3 gRPC modules import with this protobuf);
the calls are made on them directly with grpc.aio, so revision batching, errors and
deadlines are ours to see.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import grpc
from aetcd import rpc

from libs.rpc.calls import unary
from libs.rpc.options import CLIENT_OPTIONS
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from services.bootstrap.registry import Listener, RegistryFull, StaleEpoch
from services.bootstrap.store import EtcdTarget, StoreUnavailable, parse_store  # noqa: F401 (re-exported)

log = logging.getLogger("pdmesh.bootstrap.etcd")

MAGIC = b"pdmesh.member.v1\n"
CALL_TIMEOUT = 3.0
READY_TIMEOUT = 5.0  # a Watch waits this long for the view before answering UNAVAILABLE
MAX_BACKOFF = 5.0


def _range_end(prefix: bytes) -> bytes:
    """etcd's range end for every key starting with `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _trusted(name: str, kv) -> bpb.Member | None:
    """The member a `members/<name>` key holds, or None where it is not one of ours."""
    if not kv.value.startswith(MAGIC) or kv.lease == 0:
        return None
    member = bpb.Member()
    try:
        member.ParseFromString(kv.value[len(MAGIC):])
    except Exception:  # protobuf's DecodeError; any garbage is just not ours
        return None
    if (member.name != name or member.role not in (cpb.PREFILL, cpb.DECODE, cpb.ROUTER)
            or not member.address):
        return None
    member.epoch = kv.mod_revision
    return member


@dataclass
class EtcdStore:
    target: EtcdTarget
    lease_seconds: float = 5.0
    max_members: int = 256
    events_total: dict[tuple[str, str], int] = field(default_factory=dict)
    foreign_keys_total: int = 0
    connected: bool = False
    _view: dict[str, bpb.Member] = field(default_factory=dict)
    _listeners: list[Listener] = field(default_factory=list)
    _foreign_seen: set[tuple[bytes, int]] = field(default_factory=set)
    _ready: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        self.ttl = max(1, math.ceil(self.lease_seconds))  # etcd leases are whole seconds
        self.lease_seconds = float(self.ttl)
        self.members_prefix = (self.target.prefix + "members/").encode()
        self.left_prefix = (self.target.prefix + "left/").encode()
        # pdmesh's keepalives: a silently vanished etcd breaks the watch in seconds, so
        # the view is listed again instead of going stale
        self.channel = grpc.aio.insecure_channel(self.target.address, options=CLIENT_OPTIONS)
        self.kv = rpc.KVStub(self.channel)
        self.leases = rpc.LeaseStub(self.channel)
        self.watch_stub = rpc.WatchStub(self.channel)

    # -- the store interface ---------------------------------------------------------

    async def register(self, member: bpb.Member) -> bpb.Member:
        key = self.members_prefix + member.name.encode()
        stored = bpb.Member()
        stored.CopyFrom(member)
        stored.epoch = 0  # the epoch is the key's revision, not something a writer claims
        async with self._calls():
            if member.name not in self._view:
                count = await unary(self.kv.Range, rpc.RangeRequest(
                    key=self.members_prefix, range_end=_range_end(self.members_prefix),
                    count_only=True), timeout=CALL_TIMEOUT)
                if count.count >= self.max_members:
                    raise RegistryFull(f"registry holds {self.max_members} members")
            lease = await unary(self.leases.LeaseGrant, rpc.LeaseGrantRequest(TTL=self.ttl),
                                                 timeout=CALL_TIMEOUT)
            put = await unary(self.kv.Put, rpc.PutRequest(
                key=key, value=MAGIC + stored.SerializeToString(), lease=lease.ID,
                prev_kv=True), timeout=CALL_TIMEOUT)
            if put.HasField("prev_kv") and put.prev_kv.lease:
                await self._revoke(put.prev_kv.lease)
        admitted = bpb.Member()
        admitted.CopyFrom(stored)
        admitted.epoch = put.header.revision
        return admitted

    async def keep_alive(self, name: str, epoch: int) -> None:
        async with self._calls():
            kv = await self._current(name, epoch)
            call = self.leases.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=kv.lease)]),
                                              timeout=CALL_TIMEOUT)
            try:
                reply = await call.read()
            finally:
                call.cancel()
        if reply is grpc.aio.EOF or reply.TTL <= 0:
            raise StaleEpoch(f"{name} epoch {epoch}: its lease has expired")

    async def deregister(self, name: str, epoch: int) -> None:
        key = self.members_prefix + name.encode()
        async with self._calls():
            txn = await unary(self.kv.Txn, rpc.TxnRequest(
                compare=[rpc.Compare(key=key, target=rpc.Compare.MOD,
                                     result=rpc.Compare.EQUAL, mod_revision=epoch)],
                success=[
                    rpc.RequestOp(request_range=rpc.RangeRequest(key=key)),
                    rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)),
                    rpc.RequestOp(request_put=rpc.PutRequest(
                        key=self.left_prefix + name.encode(), value=b"deregistered")),
                ]), timeout=CALL_TIMEOUT)
            if not txn.succeeded:
                raise StaleEpoch(f"{name} epoch {epoch} is not registered")
            for kv in txn.responses[0].response_range.kvs:
                await self._revoke(kv.lease)

    def members(self) -> list[bpb.Member]:
        return list(self._view.values())

    def watchers(self) -> int:
        return len(self._listeners)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    async def wait_ready(self) -> None:
        """Until the view is current; StoreUnavailable after READY_TIMEOUT. A Watch must not
        hand out a snapshot of a view that missed changes: its members would drop peers."""
        with anyio.move_on_after(READY_TIMEOUT):
            await self._ready.wait()
            return
        raise StoreUnavailable(f"membership store {self.target.url} is not reachable")

    async def run(self) -> None:
        """Keep the view current forever: list, watch, and on any break list again."""
        backoff = 0.2
        while True:
            try:
                revision = await self._relist()
                backoff = 0.2
                await self._watch(revision + 1)
            except grpc.aio.AioRpcError as e:
                log.warning("membership store %s unreachable (%s); retrying in %.1fs",
                            self.target.url, e.code().name, backoff)
            self._not_ready()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def close(self) -> None:
        """After the gRPC server has stopped: its last Deregisters still need etcd."""
        await self.channel.close()

    # -- the view --------------------------------------------------------------------

    async def _relist(self) -> int:
        reply = await unary(self.kv.Range, rpc.RangeRequest(
            key=self.members_prefix, range_end=_range_end(self.members_prefix)),
            timeout=CALL_TIMEOUT)
        fresh: dict[str, bpb.Member] = {}
        for kv in reply.kvs:
            member = self._accept(kv)
            if member is not None:
                fresh[member.name] = member
        for name, old in list(self._view.items()):
            if name not in fresh or fresh[name].epoch != old.epoch:
                del self._view[name]
                self._publish(bpb.MembershipEvent.LEFT, old, "missing from the store")
        for name, member in fresh.items():
            if name not in self._view:
                self._view[name] = member
                self._publish(bpb.MembershipEvent.JOINED, member, "registered")
        if not self.connected:
            log.info("membership store %s: %d members at revision %d", self.target.url,
                     len(fresh), reply.header.revision)
        self.connected = True
        self._ready.set()
        return reply.header.revision

    async def _watch(self, start_revision: int) -> None:
        request = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=self.target.prefix.encode(), range_end=_range_end(self.target.prefix.encode()),
            start_revision=start_revision))
        send, receive = anyio.create_memory_object_stream[rpc.WatchRequest](1)
        send.send_nowait(request)

        async def requests():
            async with receive:
                async for item in receive:
                    yield item

        call = self.watch_stub.Watch(requests())
        try:
            async for response in call:
                if response.canceled or response.compact_revision:
                    log.warning("membership store %s: watch ended (%s); listing again",
                                self.target.url, response.cancel_reason or "compacted")
                    return
                self._apply(response.events)
        finally:
            call.cancel()
            send.close()

    def _apply(self, events) -> None:
        """One watch response: its events, in revision order. A delete whose revision also
        wrote `left/<name>` was a Deregister; any other delete is etcd expiring the lease."""
        deregistered = {(e.kv.key[len(self.left_prefix):].decode(errors="replace"),
                         e.kv.mod_revision)
                        for e in events
                        if e.type == rpc.Event.PUT and e.kv.key.startswith(self.left_prefix)}
        for event in events:
            if not event.kv.key.startswith(self.members_prefix):
                continue
            name = event.kv.key[len(self.members_prefix):].decode(errors="replace")
            old = self._view.get(name)
            if event.type == rpc.Event.DELETE:
                if old is not None:
                    del self._view[name]
                    reason = ("deregistered" if (name, event.kv.mod_revision) in deregistered
                              else "lease expired")
                    self._publish(bpb.MembershipEvent.LEFT, old, reason)
                continue
            member = self._accept(event.kv)
            if member is None:  # a foreign write replaced a registration: it is gone
                if old is not None:
                    del self._view[name]
                    self._publish(bpb.MembershipEvent.LEFT, old, "overwritten by a foreign key")
                continue
            if old is not None:
                self._publish(bpb.MembershipEvent.LEFT, old, "replaced by a new epoch")
            self._view[name] = member
            self._publish(bpb.MembershipEvent.JOINED, member, "registered")

    def _accept(self, kv) -> bpb.Member | None:
        name = kv.key[len(self.members_prefix):].decode(errors="replace")
        member = _trusted(name, kv)
        if member is None and (kv.key, kv.mod_revision) not in self._foreign_seen:
            self._foreign_seen.add((kv.key, kv.mod_revision))
            if len(self._foreign_seen) > 4096:  # bounded: a re-count after that is harmless
                self._foreign_seen.clear()
            self.foreign_keys_total += 1
            log.warning("membership store %s: ignoring %r, not a pdmesh registration",
                        self.target.url, kv.key[:200])
        return member

    def _publish(self, kind: int, member: bpb.Member, reason: str) -> None:
        event = bpb.MembershipEvent(kind=kind, members=[member], reason=reason)
        counted = (bpb.MembershipEvent.Kind.Name(kind).lower(), reason)
        self.events_total[counted] = self.events_total.get(counted, 0) + 1
        for listener in list(self._listeners):
            listener(event)

    def _not_ready(self) -> None:
        self.connected = False
        if self._ready.is_set():
            self._ready = anyio.Event()

    # -- helpers ---------------------------------------------------------------------

    async def _current(self, name: str, epoch: int):
        key = self.members_prefix + name.encode()
        reply = await unary(self.kv.Range, rpc.RangeRequest(key=key), timeout=CALL_TIMEOUT)
        if not reply.kvs or reply.kvs[0].mod_revision != epoch:
            raise StaleEpoch(f"{name} epoch {epoch} is not registered")
        return reply.kvs[0]

    async def _revoke(self, lease_id: int) -> None:
        try:
            await unary(self.leases.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id),
                                          timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # already expired: nothing to revoke
                raise

    def _calls(self):
        return _EtcdCalls(self.target.url)


class _EtcdCalls:
    """Turns etcd's transport failures into StoreUnavailable (gRPC UNAVAILABLE to the
    member, which retries through the next bootstrap)."""

    def __init__(self, url: str):
        self.url = url

    async def __aenter__(self):
        return self

    async def __aexit__(self, kind, error, tb):
        if isinstance(error, grpc.aio.AioRpcError):
            raise StoreUnavailable(
                f"membership store {self.url}: {error.code().name}") from error
        return False
