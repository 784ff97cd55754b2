"""The Prefill gRPC service: compute a prompt's KV chunk by chunk and WRITE it into a
decode's pool over NIXL as it goes.

Per request: validate everything before any state exists (a forged or stale
TransferInfo creates nothing), create the room, allocate local pages, then per
chunk run the forward pass on the compute thread and post a NIXL WRITE of the
pages that chunk completed. The last write carries a KvReady notification, so
the decode knows every page landed. Whatever ends the request (success, Abort,
client gone, deadline, transfer error), the finally block fences in-flight
writes before local pages go back to the pool.

With ``--kv-transfer nvfp4`` a chunk's pages are first quantized (off the loop)
into their staging slots, which is what the WRITE then reads; a slot has the id
of its KV page, so the same fence frees both (libs/transfer/staging.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
import grpc
from opentelemetry.trace import SpanKind

from libs.engine.sampling import sample
from libs.kvpoll import (
    FailureCause,
    Room,
    RoomKey,
    RoomState,
    RoomTable,
)
from libs.member import grant
from libs.member.admission import admit_room
from libs.member.kv_member import KvMember, Peer
from libs.member.metrics import MemberMetrics
from libs.member.stats import Counters, RecentKeys
from libs.member.wire import (
    check_abort_ends,
    check_tokens,
    key_from_proto,
    sampling_from_proto,
)
from libs.rpc.dump import dump
from libs.rpc.handlers import RpcError, contained, invalid
from libs.tracing import incoming_context, mark_aborted, span
from libs.transfer.errors import LayoutMismatch, TransferError
from libs.transfer.layout import check_pages
from libs.transfer.wait import wait
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import common_pb2_grpc as cgrpc
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc
from services.prefill.scheduler import STALL_SECONDS, PrefillScheduler

log = logging.getLogger(__name__)

FENCE_SECONDS = 5.0
ABORT_WAIT_SECONDS = 5.0


@dataclass
class Job:
    """One admitted prefill: its room, local pages, in-flight writes and cancel scope."""

    key: RoomKey
    room: Room
    pages: list[int]
    peer: Peer
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    transfers: list = field(default_factory=list)
    abort_reason: FailureCause | None = None
    released: anyio.Event = field(default_factory=anyio.Event)
    stage: str = "queued"  # for traces: queued | prefill | transfer
    abort_stage: str = ""  # the request's stage as the Abort's sender saw it


@dataclass
class PrefillConfig:
    chunk_tokens: int = 256
    max_batch_tokens: int = 512
    max_rooms: int = 256
    default_budget: float = 300.0


class PrefillService(pgrpc.PrefillServicer, cgrpc.AdminServicer):
    def __init__(self, member: KvMember, config: PrefillConfig, epoch=lambda: 0):
        if config.chunk_tokens % member.pool.page_size:
            raise ValueError("chunk_tokens must be a multiple of the page size")
        self.member = member
        self.config = config
        self.epoch = epoch
        self.table = RoomTable(config.max_rooms)
        self.jobs: dict[RoomKey, Job] = {}
        self.ended = RecentKeys()  # aborted or served: a replay or late leg is refused
        self.scheduler = PrefillScheduler(
            member.engine, config.max_batch_tokens,
            stall_after=member.stall_after or STALL_SECONDS,
            stall_forward=member.faults.stall_forward,
        )
        self.counters = Counters()
        member.on_peer_lost.append(self.on_peer_lost)
        self.metrics = MemberMetrics("prefill", member.name, self.snapshot)
        self._failures_to_inject = member.faults.fail_prefills  # off unless injected

    # ---- admission ---------------------------------------------------------------

    def _admit(self, request: ppb.PrefillRequest, budget: float) -> tuple[Job, list[int]]:
        key = key_from_proto(request.key)
        config = self.member.loaded.config
        tokens = check_tokens(request.prompt_tokens, config.vocab_size, config.max_position - 1)
        info = request.transfer
        if info.key != request.key:
            raise invalid("transfer.key differs from key")
        peer = self.member.peer(info.decode)
        if peer is None:  # unknown, stale, or refused at join (e.g. another KV format)
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION, self.member.why_not_peer(info.decode, "decode")
            )
        why = grant.check(
            peer.member.grant_key, info, cpb.PeerRef(name=self.member.name, epoch=self.epoch())
        )
        if why is not None:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, f"TransferInfo refused: {why}")
        n_pages = self.member.pool.pages_for(len(tokens))
        if len(info.dst_pages) != n_pages:
            raise invalid(f"transfer.dst_pages has {len(info.dst_pages)} pages, need {n_pages}")
        try:
            check_pages(peer.layout, list(info.dst_pages), "destination")
        except LayoutMismatch as e:
            raise invalid(str(e)) from e
        room, pages = admit_room(self.table, self.member.pool, self.ended, key, n_pages, budget)
        job = Job(key=key, room=room, pages=pages, peer=peer)
        self.jobs[key] = job
        return job, tokens

    # ---- the request -------------------------------------------------------------

    @contained
    async def Prefill(self, request, context):
        attributes = {"pdmesh.request.id": request.key.room.hex(),
                      "pdmesh.prompt_tokens": len(request.prompt_tokens)}
        with span("prefill", context=incoming_context(context), kind=SpanKind.SERVER,
                  attributes=attributes) as server_span:
            await self._prefill(request, context, server_span)

    async def _prefill(self, request, context, server_span) -> None:
        self.counters.requests_total += 1
        budget = context.time_remaining() or self.config.default_budget
        sampling = sampling_from_proto(request.sampling)
        job, tokens = self._admit(request, budget)
        cause: FailureCause | None = None
        try:
            with job.scope, anyio.fail_after(budget):
                await self._run(job, tokens, sampling, request.transfer, context)
            if job.scope.cancelled_caught:
                cause = job.abort_reason or FailureCause.INTERNAL
                raise RpcError(grpc.StatusCode.ABORTED, f"aborted: {cause}")
        except TimeoutError:
            cause = FailureCause.DEADLINE
            self.counters.deadline_expired_total += 1
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill deadline") from None
        except TransferError as e:
            cause = FailureCause.TRANSFER_ERROR
            self.counters.transfer_failed_total += 1
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}") from e
        except anyio.get_cancelled_exc_class():  # the caller left, or its deadline passed
            cause = self.counters.cancelled(job.room.deadline)
            raise
        except BaseException:
            cause = cause or FailureCause.INTERNAL
            raise
        finally:
            if cause is not None:
                job.room.fail(cause, time.monotonic())
                self.counters.aborts[cause.value] += 1  # once per request that ended early
                mark_aborted(server_span, cause.value, job.abort_stage or job.stage)
            with anyio.move_on_after(FENCE_SECONDS + 1, shield=True) as bounded:
                await self._release(job)
            if bounded.cancelled_caught:
                log.error("room %s: release cut short; its %d pages withheld",
                          job.key, len(job.pages))
            server_span.add_event("released", {"pdmesh.kv.pages": len(job.pages)})

    async def _run(self, job: Job, tokens, sampling, info: cpb.TransferInfo, context) -> None:
        member, pool = self.member, self.member.pool
        room, n = job.room, len(tokens)
        dst = list(info.dst_pages)
        page_size = pool.page_size
        room.transition(RoomState.WAITING_FOR_INPUT, time.monotonic())
        sent = 0
        logits = None
        started = time.perf_counter()
        faults = member.faults

        async def computing() -> None:
            """The first chunk left the queue: tell the router, whose trace names the
            stage, that the request is now in its prefill."""
            job.stage = "prefill"
            await context.write(ppb.PrefillEvent(progress=ppb.PrefillProgress(tokens_done=0)))

        for start in range(0, n, self.config.chunk_tokens):
            chunk = tokens[start : start + self.config.chunk_tokens]
            with span("prefill chunk", attributes={"pdmesh.chunk.start": start,
                                                   "pdmesh.chunk.tokens": len(chunk)}):
                logits = await self.scheduler.prefill(
                    chunk, job.pages, start, on_start=computing if start == 0 else None)
            self.counters.prompt_tokens_computed_total += len(chunk)
            done = start + len(chunk)
            if done < n and faults.pause_between_chunks:  # W4's window: a write not yet posted
                await anyio.sleep(faults.pause_between_chunks)
            if done < n:  # the last page always waits for the final, notifying write
                full = done // page_size
                if full > sent:
                    await self._stage(job, range(sent, full), None)
                    self._write(job, range(sent, full), dst, None)
                    sent = full
            await context.write(
                ppb.PrefillEvent(progress=ppb.PrefillProgress(tokens_done=done, pages_sent=sent))
            )
            if self._failures_to_inject > 0:
                self._failures_to_inject -= 1
                raise RpcError(grpc.StatusCode.UNAVAILABLE, "injected fault: fail_prefills")
        first = sample(logits, sampling, 0)
        ready = cpb.KvReady(
            key=info.key,
            prefill=cpb.PeerRef(name=member.name, epoch=self.epoch()),
            num_pages=len(dst),
            prompt_tokens=n,
            first_token=first,
        )
        deadline = room.deadline
        job.stage = "transfer"
        wire_bytes = len(dst) * member.wire.page_bytes
        attributes = {"pdmesh.kv.pages": len(dst), "pdmesh.kv.bytes": wire_bytes,
                      "pdmesh.kv.format": member.wire.name,
                      "pdmesh.kv.backend": "nixl-ucx", "pdmesh.kv.writes": len(job.transfers) + 1,
                      "pdmesh.peer": job.peer.member.name}
        with span("kv transfer", attributes=attributes) as transfer_span:
            await self._stage(job, range(sent, len(dst)), n - (len(dst) - 1) * page_size)
            for transfer in job.transfers:  # earlier chunks land before the notifying write
                await wait(transfer, deadline)
            if faults.delay_kv_ready:
                await anyio.sleep(faults.delay_kv_ready)
            notif = None if faults.drop_kv_ready else ready.SerializeToString()
            final = self._write(job, range(sent, len(dst)), dst, notif)
            await wait(final, deadline)
            transfer_span.set_attribute("pdmesh.kv.status", "ok")
        room.transition(RoomState.SUCCESS, time.monotonic())
        elapsed = time.perf_counter() - started
        result = cpb.TransferResult(
            key=info.key,
            status=cpb.TRANSFER_OK,
            first_token=first,
            pages_written=len(dst),
            bytes_written=wire_bytes,
            transfer_seconds=elapsed,
            prefill=self._ref(),
            decode=info.decode,
        )
        self.metrics.transfer_seconds.observe(elapsed)
        self.metrics.transfer_bytes.observe(result.bytes_written)
        if faults.delay_transfer_result:
            await anyio.sleep(faults.delay_transfer_result)
        if not faults.drop_transfer_result:
            await context.write(ppb.PrefillEvent(result=result))

    async def _stage(self, job: Job, pages: range, last_page_tokens: int | None) -> None:
        """nvfp4: quantize these KV pages into their staging slots, off the event loop.

        Not abandoned on cancel: the thread finishes before the caller's finally can free
        the pages it reads. ``last_page_tokens`` counts the prompt's tokens in the last page
        of ``pages`` when that page is the prompt's last (its tail is zeroed on the wire).
        """
        wire = self.member.wire
        if wire.staged and len(pages):
            src = [job.pages[i] for i in pages]
            with span("kv quantize", attributes={"pdmesh.kv.pages": len(src),
                                                 "pdmesh.kv.format": wire.name}):
                await anyio.to_thread.run_sync(wire.pack, src, last_page_tokens)

    def _write(self, job: Job, pages: range, dst: list[int], notif: bytes | None):
        src = [job.pages[i] for i in pages]
        dst_pages = [dst[i] for i in pages]
        transfer = self.member.agent.write_pages(
            job.peer.agent_name, job.peer.layout, src, dst_pages, notif
        )
        job.transfers.append(transfer)
        job.room.transition(RoomState.TRANSFERRING, time.monotonic())
        return transfer

    async def _release(self, job: Job) -> None:
        """Fence every posted write, then give the local pages back.

        A write still reading our pages must finish (or fail) before the pages
        can hold another request's KV; the deadline on the fence is the peer's
        problem to report, ours is never to reuse a page that may be read.
        """
        fenced = False
        deadline = time.monotonic() + FENCE_SECONDS  # one budget for all: the caller's
        try:  # bound must never cut the bookkeeping below short
            fenced = all([await fence(t, max(0.0, deadline - time.monotonic()))
                          for t in job.transfers])  # a list: every write is fenced
        finally:  # whatever a fence raised, the room ends; only unfenced pages are kept
            if fenced:
                self.member.pool.free(job.pages)
            else:
                log.error("room %s: writes not fenced; %d pages withheld",
                          job.key, len(job.pages))
                for transfer in job.transfers:  # kept with the pages, not leaked
                    transfer.withheld = not transfer.released
            self.table.remove(job.key)
            self.jobs.pop(job.key, None)
            self.ended.add(job.key)
            job.released.set()

    # ---- aborts and peers --------------------------------------------------------

    @contained
    async def Abort(self, request, context):
        key = key_from_proto(request.key)
        try:
            reason = FailureCause(request.reason)
        except ValueError:
            raise invalid(f"unknown abort reason {request.reason!r}") from None
        job = self.jobs.get(key)
        check_abort_ends(request.prefill, self._ref(), request.decode,
                         job.peer.ref if job is not None else None)
        self.ended.add(key)
        if job is None:
            return cpb.AbortAck(key=request.key, known=False, released=True)
        if self.member.faults.delay_abort:
            await anyio.sleep(self.member.faults.delay_abort)
        self._cancel(job, reason, request.stage)
        with anyio.move_on_after(ABORT_WAIT_SECONDS):
            await job.released.wait()
        return cpb.AbortAck(
            key=request.key,
            known=True,
            state=job.room.state.proto,
            released=job.released.is_set(),
        )

    def _ref(self) -> cpb.PeerRef:
        return cpb.PeerRef(name=self.member.name, epoch=self.epoch())

    def _cancel(self, job: Job, reason: FailureCause, stage: str = "") -> None:
        if job.abort_reason is None:
            job.abort_reason = reason
            job.abort_stage = stage
        job.scope.cancel()

    def on_peer_lost(self, member: bpb.Member, reason: str) -> None:
        """A decode left: its rooms fail at once instead of waiting for a timeout."""
        for job in list(self.jobs.values()):
            if job.peer.member.name == member.name and job.peer.member.epoch == member.epoch:
                self._cancel(job, FailureCause.PEER_LOST)

    def healthy(self) -> bool:
        return not self.scheduler.stalled()

    @contained
    async def Stats(self, request, context):
        return self.snapshot()

    def snapshot(self) -> cpb.MemberStats:
        return self.counters.stats(
            cpb.PREFILL, self.member.name, self.epoch(), self.healthy(), self.table,
            self.member.pool, pinned_after=self.member.pinned_after, requests=len(self.jobs),
            peer_of=lambda key: self.jobs[key].peer.member.name if key in self.jobs else "",
        )

    @contained
    async def Dump(self, request, context):
        return dump(self.member.name)



async def fence(transfer, seconds: float) -> bool:
    """True once `transfer` can no longer touch memory: finished, failed, or cancelled."""
    try:
        await wait(transfer, time.monotonic() + seconds)
    except TransferError:
        pass
    return transfer.release()
