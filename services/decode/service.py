"""The Decode gRPC service: reserve pages, receive the prompt's KV over NIXL, generate.

Per request: validate, create the room, reserve pages for prompt plus
max_tokens, answer first with a TransferInfo naming the destination pages,
then wait for the prefill's KvReady notification (every page landed). The
room becomes Success only then; the sequence joins the continuous batch and
its tokens stream back.

Pages that a write may still touch are never reused on a timeout alone
(invariant 5): if the request ends before KvReady, its pages go to
quarantine and come back only on a fence: the late KvReady itself, an Abort
saying the writer is fenced, or the writer's registration (epoch) gone.

With ``--kv-transfer nvfp4`` the prefill writes NVFP4 slots into this member's
staging region (slot i belongs to KV page i, so quarantining a page quarantines
its slot), and once KvReady says every slot landed they are dequantized into
the room's KV pages, off the loop, before the sequence joins the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from libs.engine.sampling import SamplingParams
from libs.kvpoll import FailureCause, Room, RoomKey, RoomState, RoomTable
from libs.member import grant
from libs.member.admission import admit_room
from libs.member.kv_member import KvMember
from libs.member.metrics import MemberMetrics
from libs.member.stats import Counters, RecentKeys
from libs.member.wire import (
    check_abort_ends,
    key_from_proto,
    key_to_proto,
    sampling_from_proto,
)
from libs.rpc.calls import close_channel, open_channel, unary
from libs.rpc.dump import dump
from libs.rpc.handlers import RpcError, contained, invalid
from libs.tracing import incoming_context, mark_aborted, span
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import common_pb2_grpc as cgrpc
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2_grpc as pgrpc
from services.decode.batcher import Batcher, Sequence

log = logging.getLogger(__name__)

ABORT_WAIT_SECONDS = 5.0
FENCE_ATTEMPTS = 5
KV_WAIT_MARGIN = 0.5  # seconds of a request's budget kept for generating after the KV


@dataclass
class Slot:
    """One admitted request on this decode."""

    key: RoomKey
    room: Room
    pages: list[int]
    prompt_pages: int
    writer: cpb.PeerRef
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ready: cpb.KvReady | None = None
    abort_reason: FailureCause | None = None
    released: anyio.Event = field(default_factory=anyio.Event)
    stage: str = "queued"  # for traces: queued | transfer | decode
    abort_stage: str = ""  # the request's stage as the Abort's sender saw it
    writer_fenced: bool = False  # an Abort said the writer released: no write can land


@dataclass
class DecodeConfig:
    max_rooms: int = 256
    max_batch: int = 64
    default_budget: float = 300.0
    notif_poll_min: float = 0.0005
    notif_poll_max: float = 0.008


class DecodeService(dgrpc.DecodeServicer, cgrpc.AdminServicer):
    def __init__(self, member: KvMember, config: DecodeConfig, epoch=lambda: 0):
        self.member = member
        self.config = config
        self.epoch = epoch
        self.table = RoomTable(config.max_rooms)
        self.slots: dict[RoomKey, Slot] = {}
        self.quarantine: dict[RoomKey, Slot] = {}
        self.ended = RecentKeys()  # aborted or served: a replay or late leg is refused
        self.counters = Counters()
        self.batcher = Batcher(member.engine, member.loaded.tokenizer, config.max_batch)
        if member.stall_after is not None:
            self.batcher.stall_after = member.stall_after
        self.unknown_notifs = 0
        self._kv_expected = anyio.Event()
        # Quarantined rooms whose writer we still have to ask; bounded by max_rooms.
        self._to_fence, self._fence_queue = anyio.create_memory_object_stream[Slot](
            config.max_rooms
        )
        member.on_peer_lost.append(self.on_peer_lost)
        self.metrics = MemberMetrics("decode", member.name, self.snapshot)

    async def run(self) -> None:
        """The service's own tasks: the batch loop and the notification poller."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.batcher.run)
            tg.start_soon(self._poll_notifications)
            tg.start_soon(self._fence_quarantine)

    # ---- admission ---------------------------------------------------------------

    def _admit(self, request: dpb.DecodeRequest, budget: float) -> tuple[Slot, SamplingParams]:
        key = key_from_proto(request.key)
        config, pool = self.member.loaded.config, self.member.pool
        params = sampling_from_proto(request.sampling)
        if request.prompt_tokens < 1:
            raise invalid("prompt_tokens must be >= 1")
        total = request.prompt_tokens + params.max_tokens
        if total > config.max_position:
            raise RpcError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"prompt ({request.prompt_tokens}) + max_tokens ({params.max_tokens}) "
                f"exceeds the context of {config.max_position}",
            )
        if self.member.peer(request.prefill) is None:  # unknown, stale, or refused at join
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                self.member.why_not_peer(request.prefill, "prefill"),
            )
        # The KV must land with time left to generate: the wait for it ends a little
        # before the call's own deadline, and fails typed, on our terms.
        wait_budget = budget - min(KV_WAIT_MARGIN, budget / 4)
        room, pages = admit_room(
            self.table, pool, self.ended, key, pool.pages_for(total), wait_budget
        )
        slot = Slot(
            key=key,
            room=room,
            pages=pages,
            prompt_pages=pool.pages_for(request.prompt_tokens),
            writer=request.prefill,
        )
        self.slots[key] = slot
        self._kv_expected.set()
        return slot, params

    # ---- the request -------------------------------------------------------------

    @contained
    async def Generate(self, request, context):
        attributes = {"pdmesh.request.id": request.key.room.hex(),
                      "pdmesh.prompt_tokens": request.prompt_tokens}
        with span("decode", context=incoming_context(context), kind=SpanKind.SERVER,
                  attributes=attributes) as server_span:
            await self._generate(request, context, server_span)

    async def _generate(self, request, context, server_span) -> None:
        self.counters.requests_total += 1
        budget = context.time_remaining() or self.config.default_budget
        called = time.perf_counter()
        with span("admission") as admission:  # KV pages for the whole request, or refused
            slot, params = self._admit(request, budget)
            admission.set_attribute("pdmesh.kv.pages", len(slot.pages))
        seq: Sequence | None = None
        cause: FailureCause | None = None
        deadline = time.monotonic() + budget
        try:
            with slot.scope:
                slot.room.transition(RoomState.WAITING_FOR_INPUT, time.monotonic())
                info = cpb.TransferInfo(
                    key=request.key,
                    decode=cpb.PeerRef(name=self.member.name, epoch=self.epoch()),
                    dst_pages=slot.pages[: slot.prompt_pages],
                )
                grant.sign(self.member.grant_key, info, slot.writer)
                await context.write(dpb.DecodeEvent(transfer=info))
                slot.stage = "transfer"
                # The room's deadline is enforced by the notification poller, which
                # drains KvReady first: a KV that landed in time is never failed late.
                with span("kv wait", attributes={"pdmesh.kv.pages": len(info.dst_pages),
                                                 "pdmesh.peer": slot.writer.name}) as wait_span:
                    state = await slot.room.wait_terminal()
                    if state is not RoomState.SUCCESS:  # failed by an Abort or its deadline
                        why = slot.abort_reason or slot.room.failure_cause
                        wait_span.set_status(Status(StatusCode.ERROR, f"room {state.name}: "
                                                    f"{why.value if why else 'unknown'}"))
                if state is RoomState.SUCCESS:
                    slot.stage = "decode"
                    ready = slot.ready
                    arrived = dpb.KvArrived(prompt_tokens=ready.prompt_tokens)
                    await context.write(dpb.DecodeEvent(kv_arrived=arrived))
                    await self._unstage(slot)
                    seq = self.batcher.admit(
                        slot.pages, ready.prompt_tokens, ready.first_token, params
                    )
                    with anyio.fail_after(max(0.0, deadline - time.monotonic())), \
                            span("generate") as generate_span:
                        await self._stream(seq, context, called)
                        generate_span.set_attribute("pdmesh.completion_tokens", seq.generated)
            if slot.scope.cancelled_caught or slot.room.state is RoomState.FAILED:
                cause = slot.abort_reason or slot.room.failure_cause or FailureCause.INTERNAL
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if cause is FailureCause.DEADLINE
                    else grpc.StatusCode.ABORTED
                )
                raise RpcError(code, f"aborted: {cause}")
        except TimeoutError:
            cause = FailureCause.DEADLINE
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "decode deadline") from None
        except anyio.get_cancelled_exc_class():  # the caller left, or its deadline passed
            cause = self.counters.cancelled(deadline)
            raise
        except BaseException:
            cause = cause or FailureCause.INTERNAL
            raise
        finally:
            if cause is not None:
                slot.room.fail(cause, time.monotonic())
                self.counters.aborts[cause.value] += 1  # once per request that ended early
                mark_aborted(server_span, cause.value, slot.abort_stage or slot.stage)
            with anyio.move_on_after(2.0, shield=True) as bounded:
                await self._release(slot, seq)
            if bounded.cancelled_caught:  # the batcher held the sequence past the bound
                log.error("room %s: release cut short; %d pages and the room kept",
                          slot.key, len(slot.pages))
            server_span.add_event(
                "quarantined" if slot.key in self.quarantine else "released",
                {"pdmesh.kv.pages": len(slot.pages)},
            )

    async def _unstage(self, slot: Slot) -> None:
        """nvfp4: dequantize the landed slots into the room's KV pages, off the loop.

        Runs after KvReady (no write can still touch these slots) and is not abandoned
        on cancel, so the pages are never freed under it.
        """
        wire = self.member.wire
        if wire.staged:
            pages = slot.pages[: slot.prompt_pages]
            with span("kv dequantize", attributes={"pdmesh.kv.pages": len(pages),
                                                   "pdmesh.kv.format": wire.name}):
                await anyio.to_thread.run_sync(wire.unpack, pages)

    async def _stream(self, seq: Sequence, context, called: float) -> None:
        last = None
        async with seq.receive:
            async for emitted in seq.receive:
                if emitted.token_ids or emitted.text:
                    chunk = dpb.TokenChunk(token_ids=emitted.token_ids, text=emitted.text)
                    await context.write(dpb.DecodeEvent(tokens=chunk))
                    now = time.perf_counter()
                    if last is None:
                        self.metrics.ttft.observe(now - called)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if emitted.finish_reason == "error":
                    raise RpcError(grpc.StatusCode.INTERNAL, "decode step failed")
                if emitted.finish_reason is not None:
                    finish = dpb.Finish(
                        finish_reason=emitted.finish_reason, completion_tokens=seq.generated
                    )
                    await context.write(dpb.DecodeEvent(finish=finish))
                    return
        raise RpcError(grpc.StatusCode.INTERNAL, "sequence ended without a finish")

    async def _release(self, slot: Slot, seq: Sequence | None) -> None:
        if seq is not None:
            self.batcher.cancel(seq)
            await seq.released.wait()
        self.slots.pop(slot.key, None)
        if slot.ready is None and not slot.writer_fenced:
            # KvReady never came: a write may still land in these pages.
            self.quarantine[slot.key] = slot
            log.info("room %s: %d pages quarantined until fenced", slot.key, len(slot.pages))
            self._to_fence.send_nowait(slot)
        else:
            self._free(slot)

    def _free(self, slot: Slot) -> None:
        self.member.pool.free(slot.pages)
        self.quarantine.pop(slot.key, None)
        if slot.key in self.table:
            self.table.remove(slot.key)
        self.ended.add(slot.key)
        slot.released.set()

    # ---- KV arrival --------------------------------------------------------------

    async def _poll_notifications(self) -> None:
        """The one owner of NIXL notifications on this decode.

        Polls (which also drives UCX progress) only while some room awaits its
        KV or a quarantine awaits its fence; an idle decode costs no CPU here.
        """
        delay = self.config.notif_poll_min
        while True:
            if not self._awaiting_kv():
                self._kv_expected = anyio.Event()
                await self._kv_expected.wait()
                delay = self.config.notif_poll_min
            notifs = self.member.agent.get_notifs()
            if notifs and self.member.faults.delay_notifications:
                await anyio.sleep(self.member.faults.delay_notifications)
            for _peer, payload in notifs:
                self._on_notification(payload)
            self._expire_rooms()  # after the drain: see RoomTable.expire
            # Each poll runs UCX progress (not free): back off while nothing arrives,
            # so a long prefill elsewhere does not cost this process a core.
            delay = self.config.notif_poll_min if notifs else min(
                delay * 2, self.config.notif_poll_max
            )
            await anyio.sleep(delay)

    def _expire_rooms(self) -> None:
        for key in self.table.expire(time.monotonic()):
            self.counters.deadline_expired_total += 1
            slot = self.slots.get(key)
            if slot is not None:
                slot.abort_reason = slot.abort_reason or FailureCause.DEADLINE
                slot.scope.cancel()

    def _awaiting_kv(self) -> bool:
        return bool(self.quarantine) or any(s.ready is None for s in self.slots.values())

    def _on_notification(self, payload: bytes) -> None:
        """KvReady: every page of a room landed. Contained: a bad message is dropped."""
        try:
            ready = cpb.KvReady.FromString(payload)
            key = key_from_proto(ready.key)
        except Exception:
            self.unknown_notifs += 1
            log.warning("dropping an unparseable notification (%d bytes)", len(payload))
            return
        slot = self.slots.get(key) or self.quarantine.get(key)
        if slot is None or ready.prefill != slot.writer or ready.num_pages != slot.prompt_pages:
            self.unknown_notifs += 1
            log.warning("dropping KvReady for %s: unknown room or wrong writer", key)
            return
        slot.ready = ready
        if key in self.quarantine:  # the late write is the fence
            self._free(slot)
            return
        outcome = slot.room.transition(RoomState.SUCCESS, time.monotonic())
        log.debug("room %s KvReady: %s", key, outcome)

    # ---- fencing quarantined pages -------------------------------------------------

    async def _fence_quarantine(self) -> None:
        """Ask the writer of every quarantined room to fence it (W2/W3).

        The router normally does this (its Abort carries writer_fenced), but a
        router that vanished sends nothing: then the decode itself tells the
        prefill to stop and waits for its AbortAck before the pages come back.
        """
        async with anyio.create_task_group() as tg:
            async for slot in self._fence_queue:
                tg.start_soon(self._ask_writer, slot)

    async def _ask_writer(self, slot: Slot) -> None:
        reason = (slot.abort_reason or slot.room.failure_cause or FailureCause.INTERNAL).value
        for attempt in range(FENCE_ATTEMPTS):
            if slot.key not in self.quarantine:
                return  # fenced meanwhile: KvReady, the router's Abort, or the writer left
            peer = self.member.peer(slot.writer)
            if peer is None:  # the writer's epoch is gone: nothing of it can land any more
                self._free(slot)
                return
            channel = open_channel(peer.member.address)
            try:
                ack = await unary(
                    pgrpc.PrefillStub(channel).Abort,
                    cpb.Abort(
                        key=key_to_proto(slot.key), reason=reason, prefill=slot.writer,
                        decode=cpb.PeerRef(name=self.member.name, epoch=self.epoch()),
                    ),
                    timeout=ABORT_WAIT_SECONDS + 1,
                )
                if ack.released and slot.key in self.quarantine:
                    self._free(slot)
                    return
            except grpc.aio.AioRpcError as e:
                log.warning("room %s: Abort to writer failed: %s", slot.key, e.code().name)
            finally:
                await close_channel(channel)
            await anyio.sleep(0.2 * 2**attempt)
        log.error("room %s: writer never acknowledged; pages stay quarantined", slot.key)

    # ---- aborts and peers --------------------------------------------------------

    @contained
    async def Abort(self, request, context):
        key = key_from_proto(request.key)
        try:
            reason = FailureCause(request.reason)
        except ValueError:
            raise invalid(f"unknown abort reason {request.reason!r}") from None
        slot = self.slots.get(key) or self.quarantine.get(key)
        me = cpb.PeerRef(name=self.member.name, epoch=self.epoch())
        check_abort_ends(request.decode, me, request.prefill,
                         slot.writer if slot is not None else None)
        self.ended.add(key)
        if slot is None:
            return cpb.AbortAck(key=request.key, known=False, released=True)
        if slot.abort_reason is None:
            slot.abort_reason = reason
            slot.abort_stage = request.stage
        slot.room.fail(reason, time.monotonic())
        slot.writer_fenced |= request.writer_fenced  # its release then frees, not quarantines
        slot.scope.cancel()
        if request.writer_fenced and key in self.quarantine:
            self._free(slot)
        with anyio.move_on_after(ABORT_WAIT_SECONDS):
            if request.writer_fenced:
                await slot.released.wait()
            else:
                while key in self.slots:
                    await anyio.sleep(0.001)
        quarantined = key in self.quarantine
        return cpb.AbortAck(
            key=request.key,
            known=True,
            state=slot.room.state.proto,
            released=slot.released.is_set() or quarantined,
        )

    def on_peer_lost(self, member: bpb.Member, reason: str) -> None:
        """A prefill left: its rooms fail now, and its quarantined pages are fenced."""
        lost = cpb.PeerRef(name=member.name, epoch=member.epoch)
        for slot in list(self.slots.values()):
            if slot.writer == lost and slot.ready is None:
                if slot.abort_reason is None:
                    slot.abort_reason = FailureCause.PEER_LOST
                slot.room.fail(FailureCause.PEER_LOST, time.monotonic())
                slot.scope.cancel()
        for slot in list(self.quarantine.values()):
            if slot.writer == lost:
                self._free(slot)

    def healthy(self) -> bool:
        return not self.batcher.stalled()

    @contained
    async def Stats(self, request, context):
        return self.snapshot()

    def snapshot(self) -> cpb.MemberStats:
        return self.counters.stats(
            cpb.DECODE, self.member.name, self.epoch(), self.healthy(), self.table,
            self.member.pool, pinned_after=self.member.pinned_after, requests=len(self.slots),
            peer_of=self._writer_name,
        )

    def _writer_name(self, key: RoomKey) -> str:
        slot = self.slots.get(key) or self.quarantine.get(key)
        return slot.writer.name if slot is not None else ""

    @contained
    async def Dump(self, request, context):
        return dump(self.member.name)
