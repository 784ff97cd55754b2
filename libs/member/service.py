"""What a prefill and a decode service share: their bookkeeping, Abort, Stats and Dump.

Both hold a bounded room table, their live requests by room, the rooms that recently
ended here (a late leg or a replay is refused), live counters, and one compute loop whose
stall is their health. Both answer an Abort the same way: refuse one meant for another
life of this member or for another pair's room, remember the room as ended, stop the
request (what stopping means is the role's), then wait a bounded time for its release
before acknowledging, so the sender learns whether the pages are settled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
from opentelemetry.trace import Span, SpanKind

from libs.kvpoll import FailureCause, RoomKey, RoomTable
from libs.member.lifecycle import Lifecycle, Request
from libs.member.loop import ComputeLoop
from libs.member.metrics import MemberMetrics
from libs.member.stats import Counters, RecentKeys
from libs.member.timeouts import TIMEOUTS
from libs.member.wire import check_abort_ends, key_from_proto
from libs.rpc.dump import dump
from libs.rpc.handlers import contained, invalid
from libs.tracing import incoming_context, span
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import common_pb2_grpc as cgrpc

if TYPE_CHECKING:
    from libs.member.kv_member import KvMember


@dataclass(kw_only=True)
class MemberConfig:
    max_rooms: int = 256
    default_budget: float = 300.0  # seconds, for a call that carries no deadline


class MemberService(cgrpc.AdminServicer):
    """Base of the prefill and decode services; see the module docstring.

    A subclass names its ``role`` and ``role_name``, bounds its release with
    ``release_seconds``, and implements ``run`` (its own tasks), ``_release`` (give a
    request's pages back; returns ``released`` or ``quarantined``), ``_stop`` (what an
    Abort does to a held request) and ``on_peer_lost``.
    """

    role: int  # cpb.PREFILL | cpb.DECODE
    role_name: str
    release_seconds: float

    def __init__(self, member: KvMember, config: MemberConfig, epoch: Callable[[], int],
                 loop: ComputeLoop) -> None:
        self.member = member
        self.config = config
        self.epoch = epoch
        self.compute = loop
        self.table = RoomTable(config.max_rooms)
        self.requests: dict[RoomKey, Request] = {}
        self.ended = RecentKeys()  # aborted or served: a replay or late leg is refused
        self.counters = Counters()
        member.on_peer_lost.append(self.on_peer_lost)
        self.metrics = MemberMetrics(self.role_name, member.name, self.snapshot)

    def ref(self) -> cpb.PeerRef:
        """This member as its peers name it: name and current epoch."""
        return cpb.PeerRef(name=self.member.name, epoch=self.epoch())

    def find(self, key: RoomKey) -> Request | None:
        """The request of this room while this member holds it."""
        return self.requests.get(key)

    def prepare(self) -> None:
        """Blocking start-up work before the member registers (run in a thread); may raise
        DoesNotFit. Nothing by default."""

    async def run(self) -> None:
        """The service's own tasks (its compute loop among them); runs until cancelled."""
        raise NotImplementedError

    # ---- the request -------------------------------------------------------------

    def arrived(self, context) -> float:
        """Count a request that arrived; returns its budget: the call's remaining time, or
        the default for a call that carries no deadline."""
        self.counters.requests_total += 1
        return context.time_remaining() or self.config.default_budget

    def request_span(self, context, key: cpb.RoomKey, prompt_tokens: int):
        """The server span of one request, in the caller's trace."""
        return span(self.role_name, context=incoming_context(context), kind=SpanKind.SERVER,
                    attributes={"pdmesh.request.id": key.room.hex(),
                                "pdmesh.prompt_tokens": prompt_tokens})

    def lifecycle(self, request: Request, server_span: Span, deadline: float) -> Lifecycle:
        """``async with`` around the request's handler (see Lifecycle)."""
        return Lifecycle(request, self.counters, server_span, deadline=deadline,
                         release=lambda: self._release(request), bound=self.release_seconds)

    async def _release(self, request: Request) -> str:
        raise NotImplementedError

    # ---- aborts and peers --------------------------------------------------------

    @contained
    async def Abort(self, request, context):
        key = key_from_proto(request.key)
        try:
            reason = FailureCause(request.reason)
        except ValueError:
            raise invalid(f"unknown abort reason {request.reason!r}") from None
        held = self.find(key)
        named_me, named_peer = ((request.prefill, request.decode) if self.role == cpb.PREFILL
                                else (request.decode, request.prefill))
        check_abort_ends(named_me, self.ref(), named_peer,
                         held.peer_ref if held is not None else None)
        self.ended.add(key)
        if held is None:
            return cpb.AbortAck(key=request.key, known=False, released=True)
        await self._stop(held, reason, request)
        with anyio.move_on_after(TIMEOUTS.abort_wait_seconds):
            await held.released.wait()
        return cpb.AbortAck(
            key=request.key,
            known=True,
            state=held.room.state.proto,
            released=held.released.is_set(),
        )

    async def _stop(self, held: Request, reason: FailureCause, abort: cpb.Abort) -> None:
        raise NotImplementedError

    def on_peer_lost(self, member: bpb.Member, reason: str) -> None:
        raise NotImplementedError

    # ---- admin -------------------------------------------------------------------

    def healthy(self) -> bool:
        return not self.compute.stalled()

    @contained
    async def Stats(self, request, context):
        return self.snapshot()

    def snapshot(self) -> cpb.MemberStats:
        return self.counters.stats(
            self.role, self.member.name, self.epoch(), self.healthy(), self.table,
            self.member.pool, pinned_after=self.member.pinned_after,
            requests=len(self.requests), peer_of=self._peer_name,
        )

    def _peer_name(self, key: RoomKey) -> str:
        held = self.find(key)
        return held.peer_ref.name if held is not None else ""

    @contained
    async def Dump(self, request, context):
        return dump(self.member.name)
