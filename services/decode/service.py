"""The Decode gRPC service: reserve pages, receive the prompt's KV over NIXL, generate.

Per request: validate, create the room, reserve pages for the prompt plus a
growth margin (services/decode/growth.py: further pages come as the sequence
grows, and a sequence the pool cannot grow is preempted, newest first), answer
first with a TransferInfo naming the destination pages, then wait for the
prefill's KvReady notification (every page landed). The room becomes Success
only then; the sequence joins the continuous batch and its tokens stream back,
ending with a Finish, or with a Preempted the router answers with a re-run.

Pages that a write may still touch are never reused on a timeout alone
(invariant 5): if the request ends before KvReady, its pages go to
quarantine and come back only on a fence: the late KvReady itself, an Abort
saying the writer is fenced, or the writer's registration (epoch) gone.

With the prefix cache on, admission holds the cached pages of the prompt's longest cached
prefix (pinned until the request ends: no eviction can take them) and names them in the
TransferInfo (``held_pages``), so the prefill writes only the rest. A sequence that
finishes (stop or length) seals the full pages whose KV it holds, prompt and generated
tokens alike, and offers them to the cache on release, ready for the conversation's next
turn; a request that ends any other way shares nothing.

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
from opentelemetry.trace import Status, StatusCode

from libs.engine.sampling import SamplingParams
from libs.kvpoll import FailureCause, RoomKey, RoomState
from libs.member import grant
from libs.member.admission import admit_room
from libs.member.kv_member import KvMember
from libs.member.lifecycle import Request
from libs.member.metrics import SecondsByPart
from libs.member.service import MemberConfig, MemberService
from libs.member.timeouts import TIMEOUTS
from libs.member.wire import (
    check_tokens,
    key_from_proto,
    key_to_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from libs.rpc.calls import close_channel, open_channel, unary
from libs.rpc.handlers import RpcError, contained, invalid
from libs.tracing import span
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2_grpc as pgrpc
from services.decode.batcher import Batcher, Sequence
from services.decode.growth import Reservation
from services.decode.stream import TokenStream

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Slot(Request):
    """One admitted request on this decode: besides its room and pages, its writer, the
    KvReady that says its prompt's KV landed, and its sequence once decoding."""

    prompt_pages: int
    writer: cpb.PeerRef
    tokens: list[int] = field(default_factory=list)  # the prompt, when the router sent it
    held_pages: int = 0  # leading pages from this decode's cache: nothing is written there
    finished: bool = False  # streamed its Finish: every KV it holds is complete
    ready: cpb.KvReady | None = None
    seq: Sequence | None = None
    writer_fenced: bool = False  # an Abort said the writer released: no write can land

    @property
    def peer_ref(self) -> cpb.PeerRef:
        return self.writer


@dataclass(kw_only=True)
class DecodeConfig(MemberConfig):
    max_batch: int = 64
    reservation: Reservation = field(default_factory=Reservation)
    # Token messages a second over all streams, 0 for no pace (`pdmesh decode` sets
    # --message-rate, default services.decode.main.DEFAULT_MESSAGE_RATE).
    message_rate: float = 0.0
    overlap_steps: bool = False  # --overlap-steps
    notif_poll_min: float = 0.0005
    notif_poll_max: float = 0.008


class DecodeService(MemberService, dgrpc.DecodeServicer):
    role, role_name = cpb.DECODE, "decode"
    release_seconds = TIMEOUTS.decode_release_seconds

    def __init__(self, member: KvMember, config: DecodeConfig, epoch=lambda: 0):
        self.batcher = Batcher(
            member.engine, member.loaded.tokenizer.eos_token_ids, config.max_batch,
            stall_after=TIMEOUTS.decode_stall_seconds if member.stall_after is None
            else member.stall_after,
            stall_step=member.faults.stall_step, overlap=config.overlap_steps,
        )
        super().__init__(member, config, epoch, self.batcher)
        self.metrics.registry.register(SecondsByPart(
            self.metrics.labels, "pdmesh_decode_steps", "pdmesh_decode_step_seconds",
            "Decode steps (services/decode/batcher.py says what each part is)",
            lambda: (self.batcher.steps, dict(self.batcher.step_seconds))))
        self.quarantine: dict[RoomKey, Slot] = {}
        self.unknown_notifs = 0
        self._kv_expected = anyio.Event()
        # Quarantined rooms whose writer we still have to ask; bounded by max_rooms.
        self._to_fence, self._fence_queue = anyio.create_memory_object_stream[Slot](
            config.max_rooms
        )
        # Releases cut short by their bound while the batch still held the sequence.
        self._to_finish, self._late_releases = anyio.create_memory_object_stream[Slot](
            config.max_rooms
        )

    def prepare(self) -> None:
        """Capture the decode graphs for every batch this service can step (CUDA)."""
        self.member.capture_graphs(decode_batch=self.config.max_batch)

    async def run(self) -> None:
        """The service's own tasks: the batch loop and the notification poller."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.batcher.run)
            tg.start_soon(self._poll_notifications)
            tg.start_soon(self._fence_quarantine)
            tg.start_soon(self._finish_late_releases)

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
        tokens = list(request.prompt_token_ids)
        if tokens:
            if len(tokens) != request.prompt_tokens:
                raise invalid(f"prompt_token_ids has {len(tokens)} tokens, prompt_tokens says "
                              f"{request.prompt_tokens}")
            check_tokens(tokens, config.vocab_size, config.max_position)
        if self.member.peer(request.prefill) is None:  # unknown, stale, or refused at join
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                self.member.why_not_peer(request.prefill, "prefill"),
            )
        if pool.pages_for(total) > pool.num_pages:  # could never finish, even alone:
            raise RpcError(  # OUT_OF_RANGE, not RESOURCE_EXHAUSTED, which the router queues
                grpc.StatusCode.OUT_OF_RANGE,
                f"KV pool exhausted: prompt + max_tokens need {pool.pages_for(total)} pages, "
                f"more than the whole pool ({pool.num_pages})",
            )
        reserve = self.config.reservation.admit_tokens(request.prompt_tokens, params.max_tokens)
        # The KV must land with time left to generate: the wait for it ends a little
        # before the call's own deadline, and fails typed, on our terms.
        room, pages, held = admit_room(
            self.table, pool, self.ended, key, pool.pages_for(reserve), TIMEOUTS.kv_wait(budget),
            prefix=tokens, max_hit_pages=len(tokens) // pool.page_size,
        )
        slot = Slot(
            key=key,
            room=room,
            pages=pages,
            prompt_pages=pool.pages_for(request.prompt_tokens),
            writer=request.prefill,
            tokens=tokens,
            held_pages=held,
        )
        self.requests[key] = slot
        self._kv_expected.set()
        return slot, params

    # ---- the request -------------------------------------------------------------

    @contained
    async def Generate(self, request, context):
        with self.request_span(context, request.key, request.prompt_tokens) as server_span:
            await self._generate(request, context, server_span)

    async def _generate(self, request, context, server_span) -> None:
        budget = self.arrived(context)
        called = time.perf_counter()
        with span("admission") as admission:  # the prompt's pages and a margin, or refused
            slot, params = self._admit(request, budget)
            admission.set_attribute("pdmesh.kv.pages", len(slot.pages))
        deadline = time.monotonic() + budget
        async with self.lifecycle(slot, server_span, deadline) as life:
            try:
                with slot.scope:
                    await self._run(slot, params, request, context, called, deadline)
            except TimeoutError:
                life.fail(FailureCause.DEADLINE)
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "decode deadline") from None
            if (cause := life.aborted()) is not None:
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if cause is FailureCause.DEADLINE
                    else grpc.StatusCode.ABORTED
                )
                raise RpcError(code, f"aborted: {cause}")

    async def _run(self, slot: Slot, params: SamplingParams, request, context,
                   called: float, deadline: float) -> None:
        """Offer the pages, wait for their KV, then stream the tokens until the Finish."""
        slot.room.transition(RoomState.WAITING_FOR_INPUT, time.monotonic())
        self.member.pool.check_private(slot.pages[slot.held_pages : slot.prompt_pages])
        info = cpb.TransferInfo(key=request.key, decode=self.ref(),
                                dst_pages=slot.pages[: slot.prompt_pages],
                                held_pages=slot.held_pages)
        grant.sign(self.member.grant_key, info, slot.writer)
        await context.write(dpb.DecodeEvent(transfer=info))
        slot.stage = "transfer"
        # The room's deadline is enforced by the notification poller, which
        # drains KvReady first: a KV that landed in time is never failed late.
        with span("kv wait", attributes={"pdmesh.kv.pages": len(info.dst_pages),
                                         "pdmesh.kv.held_pages": slot.held_pages,
                                         "pdmesh.peer": slot.writer.name}) as wait_span:
            state = await slot.room.wait_terminal()
            if state is not RoomState.SUCCESS:  # failed by an Abort or its deadline
                why = slot.abort_reason or slot.room.failure_cause
                wait_span.set_status(Status(StatusCode.ERROR, f"room {state.name}: "
                                            f"{why.value if why else 'unknown'}"))
                return
        slot.stage = "decode"
        ready = slot.ready
        arrived = dpb.KvArrived(prompt_tokens=ready.prompt_tokens)
        await context.write(dpb.DecodeEvent(kv_arrived=arrived))
        await self._unstage(slot)
        seq = slot.seq = self.batcher.admit(
            slot.pages, ready.prompt_tokens, ready.first_token, params
        )
        with anyio.fail_after(max(0.0, deadline - time.monotonic())), \
                span("generate") as generate_span:
            completion_tokens, preempted = await self._stream(slot, seq, context, called)
            generate_span.set_attribute("pdmesh.completion_tokens", completion_tokens)
            if preempted:
                generate_span.add_event("preempted", {"pdmesh.completion_tokens":
                                                      completion_tokens})
                generate_span.set_attribute("pdmesh.preempted", True)

    def _pace(self) -> float:
        """A stream's least time between messages: its share of --message-rate."""
        rate = self.config.message_rate
        return len(self.batcher.running) / rate if rate > 0 else 0.0

    async def _unstage(self, slot: Slot) -> None:
        """nvfp4: dequantize the landed slots into the room's KV pages, off the loop.

        Runs after KvReady (no write can still touch these slots) and is not abandoned
        on cancel, so the pages are never freed under it.
        """
        wire = self.member.wire
        if wire.staged:
            pages = slot.pages[slot.held_pages : slot.prompt_pages]  # held ones are KV
            with span("kv dequantize", attributes={"pdmesh.kv.pages": len(pages),
                                                   "pdmesh.kv.format": wire.name}):
                await anyio.to_thread.run_sync(wire.unpack, pages)

    async def _stream(self, slot: Slot, seq: Sequence, context, called: float
                      ) -> tuple[int, bool]:
        """Send the sequence's tokens, several to a message when the writes fall behind,
        then its Finish (or its Preempted); returns the completion tokens and whether it
        was preempted."""
        tokens = TokenStream(seq, self.member.loaded.tokenizer, self.batcher.cancel,
                             self._pace)
        last = None
        with seq.tokens.reading():
            while True:
                try:
                    chunk = await tokens.next()
                except anyio.EndOfStream:
                    raise RpcError(grpc.StatusCode.INTERNAL,
                                   "sequence ended without a finish") from None
                if chunk.token_ids or chunk.text:
                    message = dpb.TokenChunk(
                        token_ids=chunk.token_ids, text=chunk.text,
                        logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs],
                    )
                    await context.write(dpb.DecodeEvent(tokens=message))
                    now = time.perf_counter()
                    if last is None:
                        self.metrics.ttft.observe(now - called)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if chunk.finish_reason == "error":
                    raise RpcError(grpc.StatusCode.INTERNAL, "decode step failed")
                if chunk.finish_reason == "preempted":
                    preempted = dpb.Preempted(completion_tokens=tokens.completion_tokens)
                    await context.write(dpb.DecodeEvent(preempted=preempted))
                    return tokens.completion_tokens, True
                if chunk.finish_reason is not None:
                    slot.finished = True
                    finish = dpb.Finish(finish_reason=chunk.finish_reason,
                                        completion_tokens=tokens.completion_tokens)
                    await context.write(dpb.DecodeEvent(finish=finish))
                    return tokens.completion_tokens, False

    async def _release(self, slot: Slot) -> str:
        """Take the sequence out of the batch, then free the pages, or quarantine them
        while a write may still land in them."""
        if slot.seq is not None:  # the batcher lets go of it within one step
            self.batcher.cancel(slot.seq)
            try:
                await slot.seq.released.wait()
            except anyio.get_cancelled_exc_class():
                # The release's bound ran out before the step ended (a host too loaded to
                # finish one step in time): the rest of the release waits for the batch
                # to let go, so the room's pages are kept until then, never lost.
                self._to_finish.send_nowait(slot)
                raise
        return self._release_pages(slot)

    async def _finish_late_releases(self) -> None:
        async def finish(slot: Slot) -> None:
            await slot.seq.released.wait()
            outcome = self._release_pages(slot)
            log.warning("room %s: released late (%s)", slot.key, outcome)

        async with anyio.create_task_group() as tg:
            async for slot in self._late_releases:
                tg.start_soon(finish, slot)

    def _release_pages(self, slot: Slot) -> str:
        """The release once no step can touch the pages: free them, or quarantine them
        while a write may still land."""
        self.requests.pop(slot.key, None)
        if slot.ready is None and not slot.writer_fenced:
            # KvReady never came: a write may still land in these pages.
            self.quarantine[slot.key] = slot
            log.info("room %s: %d pages quarantined until fenced", slot.key, len(slot.pages))
            self._to_fence.send_nowait(slot)
            outcome = "quarantined"
        else:
            if slot.finished and slot.tokens:
                self._publish(slot)
            self._free(slot)
            outcome = "released"
        slot.released.set()
        return outcome

    def _publish(self, slot: Slot) -> None:
        """Seal and offer the full pages whose KV this finished sequence holds: the
        prompt's (KvReady landed) and the generated tokens' but the last (never fed)."""
        pool, seq = self.member.pool, slot.seq
        tokens = slot.tokens + seq.history[: seq.generated - 1]
        full = len(tokens) // pool.page_size
        pool.seal(slot.pages[:full])
        pool.publish(tokens, slot.pages[:full])

    def _free(self, slot: Slot) -> None:
        self.member.pool.free(slot.pages)
        self.quarantine.pop(slot.key, None)
        if slot.key in self.table:
            self.table.remove(slot.key)
        self.ended.add(slot.key)

    def snapshot(self) -> cpb.MemberStats:
        stats = super().snapshot()
        stats.preemptions_total = self.batcher.preemptions
        return stats

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
            slot = self.requests.get(key)
            if slot is not None:
                slot.cancel(FailureCause.DEADLINE)

    def _awaiting_kv(self) -> bool:
        return bool(self.quarantine) or any(s.ready is None for s in self.requests.values())

    def _on_notification(self, payload: bytes) -> None:
        """KvReady: every page of a room landed. Contained: a bad message is dropped."""
        try:
            ready = cpb.KvReady.FromString(payload)
            key = key_from_proto(ready.key)
        except Exception:
            self.unknown_notifs += 1
            log.warning("dropping an unparseable notification (%d bytes)", len(payload))
            return
        slot = self.find(key)
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
        for attempt in range(TIMEOUTS.fence_attempts):
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
                        decode=self.ref(),
                    ),
                    timeout=TIMEOUTS.writer_abort_seconds,
                )
                if ack.released and slot.key in self.quarantine:
                    self._free(slot)
                    return
            except grpc.aio.AioRpcError as e:
                log.warning("room %s: Abort to writer failed: %s", slot.key, e.code().name)
            finally:
                await close_channel(channel)
            await anyio.sleep(TIMEOUTS.fence_backoff * 2**attempt)
        log.error("room %s: writer never acknowledged; pages stay quarantined", slot.key)

    # ---- aborts and peers --------------------------------------------------------

    def find(self, key: RoomKey) -> Slot | None:
        """A live request's slot, or a released one whose pages are quarantined."""
        return self.requests.get(key) or self.quarantine.get(key)

    async def _stop(self, slot: Slot, reason: FailureCause, abort: cpb.Abort) -> None:
        slot.cancel(reason, abort.stage)
        slot.room.fail(reason, time.monotonic())
        slot.writer_fenced |= abort.writer_fenced  # its release then frees, not quarantines
        if abort.writer_fenced and slot.key in self.quarantine:
            self._free(slot)

    def on_peer_lost(self, member: bpb.Member, reason: str) -> None:
        """A prefill left: its rooms fail now, and its quarantined pages are fenced."""
        lost = cpb.PeerRef(name=member.name, epoch=member.epoch)
        for slot in list(self.requests.values()):
            if slot.writer == lost and slot.ready is None:
                slot.cancel(FailureCause.PEER_LOST)
                slot.room.fail(FailureCause.PEER_LOST, time.monotonic())
        for slot in list(self.quarantine.values()):
            if slot.writer == lost:
                self._free(slot)
