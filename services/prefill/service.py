"""The Prefill gRPC service: compute a prompt's KV chunk by chunk and WRITE it into a
decode's pool over NIXL as it goes.

Per request: validate everything before any state exists (a forged or stale
TransferInfo creates nothing), create the room, allocate local pages, then per
chunk run the forward pass on the compute thread and post a NIXL WRITE of the
pages that chunk completed. A write is not awaited where it is posted: it moves
while the next chunk computes, and all of them are awaited before the last
write, which carries a KvReady notification, so the decode knows every page
landed. Whatever ends the request (success, Abort, client gone, deadline,
transfer error), its release fences in-flight writes before local pages go back
to the pool.

The "kv transfer" span (from the last chunk to KvReady landed) records the KV's
bytes, its writes and their NIXL descriptors, and the GB/s of the last write:
the one the request waits on, timed from its post to done. The earlier writes
overlap compute, so their completion is only seen when polled and their time
says nothing about the link.

With the prefix cache on, the prompt's longest cached prefix (whole pages, short of the
last token, whose logits the first token needs) is held from admission and only the rest
is computed, chunk by chunk from there. The decode's TransferInfo names the leading pages
it holds already (``held_pages``): only the pages after them are written, and a prompt the
decode holds whole moves no KV, only the KvReady. A request that succeeded seals its pages
once its writes are fenced and offers them to the cache on release.

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

from libs.engine.logprobs import token_logprobs
from libs.engine.sampling import sample
from libs.kvpoll import FailureCause, RoomState
from libs.member import grant
from libs.member.admission import admit_room
from libs.member.kv_member import KvMember, Peer
from libs.member.lifecycle import Request
from libs.member.service import MemberConfig, MemberService
from libs.member.timeouts import TIMEOUTS
from libs.member.wire import (
    check_tokens,
    key_from_proto,
    logprob_to_proto,
    sampling_from_proto,
)
from libs.rpc.handlers import RpcError, contained, invalid
from libs.tracing import span
from libs.transfer.agent import Notified
from libs.transfer.errors import LayoutMismatch, TransferError
from libs.transfer.layout import check_pages
from libs.transfer.wait import wait
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc
from services.prefill.scheduler import PrefillScheduler

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Job(Request):
    """One admitted prefill: besides its room and pages, its decode and in-flight writes."""

    peer: Peer
    tokens: list[int]
    cached_pages: int = 0  # leading pages from this prefill's cache: not computed
    transfers: list = field(default_factory=list)

    @property
    def peer_ref(self) -> cpb.PeerRef:
        return self.peer.ref


RECLAIM_EVERY_S = 1.0  # how often withheld pages are asked for a late fence


@dataclass(frozen=True)
class Withheld:
    """A request's pages kept out of use because a write of them missed its fence."""

    key: object
    pages: list[int]
    transfers: list


@dataclass(kw_only=True)
class PrefillConfig(MemberConfig):
    chunk_tokens: int = 256
    max_batch_tokens: int = 512


class PrefillService(MemberService, pgrpc.PrefillServicer):
    role, role_name = cpb.PREFILL, "prefill"
    release_seconds = TIMEOUTS.prefill_release_seconds

    def __init__(self, member: KvMember, config: PrefillConfig, epoch=lambda: 0):
        if config.chunk_tokens % member.pool.page_size:
            raise ValueError("chunk_tokens must be a multiple of the page size")
        self.scheduler = PrefillScheduler(
            member.engine, config.max_batch_tokens,
            stall_after=member.stall_after or TIMEOUTS.prefill_stall_seconds,
            stall_forward=member.faults.stall_forward,
        )
        super().__init__(member, config, epoch, self.scheduler)
        self._failures_to_inject = member.faults.fail_prefills  # off unless injected
        self.withheld: list[Withheld] = []  # pages whose writes missed their fence

    def prepare(self) -> None:
        """Capture the prefill graphs for every pack this service can run (CUDA)."""
        self.member.capture_graphs(prefill_tokens=self.config.max_batch_tokens)

    async def run(self) -> None:
        """The service's own tasks: the prefill scheduler, and the late fences of
        withheld pages."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.scheduler.run)
            tg.start_soon(self._reclaim_withheld)

    async def _reclaim_withheld(self, every: float = RECLAIM_EVERY_S) -> None:
        """Give back withheld pages once every write of theirs is fenced after all (it
        finished or failed late, as writes over a lossy link do, or its peer's agent was
        dropped): the same test a fence makes, asked again, so a slow link costs pages
        for as long as a write may still read them, not for the rest of the process."""
        while True:
            await anyio.sleep(every)
            for kept in list(self.withheld):
                if all([await fence(t, 0.0) for t in kept.transfers]):  # a list: ask each
                    self.withheld.remove(kept)
                    self.member.pool.free(kept.pages)
                    log.warning("room %s: its writes were fenced late; %d withheld pages "
                                "freed", kept.key, len(kept.pages))

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
        why = grant.check(peer.member.grant_key, info, self.ref())
        if why is not None:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED, f"TransferInfo refused: {why}")
        n_pages = self.member.pool.pages_for(len(tokens))
        if len(info.dst_pages) != n_pages:
            raise invalid(f"transfer.dst_pages has {len(info.dst_pages)} pages, need {n_pages}")
        if info.held_pages > n_pages:
            raise invalid(f"transfer.held_pages ({info.held_pages}) exceeds the prompt's "
                          f"{n_pages} pages")
        try:
            check_pages(peer.layout, list(info.dst_pages), "destination")
        except LayoutMismatch as e:
            raise invalid(str(e)) from e
        # Prompt logprobs score every prompt token, so they need the whole prompt computed.
        prefix = () if request.sampling.prompt_logprobs else tokens
        room, pages, cached = admit_room(
            self.table, self.member.pool, self.ended, key, n_pages, budget,
            prefix=prefix, max_hit_pages=(len(tokens) - 1) // self.member.pool.page_size,
        )
        job = Job(key=key, room=room, pages=pages, peer=peer, tokens=tokens,
                  cached_pages=cached)
        self.requests[key] = job
        return job, tokens

    # ---- the request -------------------------------------------------------------

    @contained
    async def Prefill(self, request, context):
        with self.request_span(context, request.key, len(request.prompt_tokens)) as server_span:
            await self._prefill(request, context, server_span)

    async def _prefill(self, request, context, server_span) -> None:
        budget = self.arrived(context)
        sampling = sampling_from_proto(request.sampling)
        job, tokens = self._admit(request, budget)
        async with self.lifecycle(job, server_span, job.room.deadline) as life:
            try:
                with job.scope, anyio.fail_after(budget):
                    await self._run(job, tokens, sampling, request.transfer, context)
            except TimeoutError:
                life.fail(FailureCause.DEADLINE)
                self.counters.deadline_expired_total += 1
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill deadline") from None
            except TransferError as e:
                life.fail(FailureCause.TRANSFER_ERROR)
                self.counters.transfer_failed_total += 1
                raise RpcError(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}") from e
            if (cause := life.aborted()) is not None:
                raise RpcError(grpc.StatusCode.ABORTED, f"aborted: {cause}")

    async def _run(self, job: Job, tokens, sampling, info: cpb.TransferInfo, context) -> None:
        member, pool = self.member, self.member.pool
        room, n = job.room, len(tokens)
        dst = list(info.dst_pages)
        page_size = pool.page_size
        room.transition(RoomState.WAITING_FOR_INPUT, time.monotonic())
        sent = info.held_pages  # the decode holds the pages before these already
        first_chunk = job.cached_pages * page_size  # ours are cached up to here
        logits = None
        prompt_logprobs: list[cpb.TokenLogprob] = []
        started = time.perf_counter()
        faults = member.faults

        async def computing() -> None:
            """The first chunk left the queue: tell the router, whose trace names the
            stage, that the request is now in its prefill."""
            job.stage = "prefill"
            await context.write(ppb.PrefillEvent(progress=ppb.PrefillProgress(tokens_done=0)))

        for start in range(first_chunk, n, self.config.chunk_tokens):
            chunk = tokens[start : start + self.config.chunk_tokens]
            pool.check_private(job.pages[start // page_size : pool.pages_for(start + len(chunk))])
            with span("prefill chunk", attributes={"pdmesh.chunk.start": start,
                                                   "pdmesh.chunk.tokens": len(chunk)}):
                logits = await self.scheduler.prefill(
                    chunk, job.pages, start,
                    on_start=computing if start == first_chunk else None,
                    all_logits=sampling.prompt_logprobs)
            if sampling.prompt_logprobs:  # every row predicts the token after it
                prompt_logprobs += await self._prompt_logprobs(logits, tokens, start, sampling)
                logits = logits[-1]
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
        first = sample(logits, sampling, sampling.start_step)
        first_logprob = None
        if sampling.logprobs:
            [lp] = token_logprobs(logits[None], [first], [sampling.top_logprobs])
            first_logprob = logprob_to_proto(lp)
        ready = cpb.KvReady(
            key=info.key,
            prefill=self.ref(),
            num_pages=len(dst),
            prompt_tokens=n,
            first_token=first,
        )
        deadline = room.deadline
        job.stage = "transfer"
        moved_pages = len(dst) - info.held_pages
        wire_bytes = moved_pages * member.wire.page_bytes
        skipped_bytes = info.held_pages * member.wire.page_bytes
        attributes = {"pdmesh.kv.pages": moved_pages, "pdmesh.kv.bytes": wire_bytes,
                      "pdmesh.kv.skipped_bytes": skipped_bytes,
                      "pdmesh.kv.format": member.wire.name,
                      "pdmesh.kv.backend": "nixl-ucx", "pdmesh.kv.writes": len(job.transfers) + 1,
                      "pdmesh.peer": job.peer.member.name}
        tail_started = time.perf_counter()
        with span("kv transfer", attributes=attributes) as transfer_span:
            await self._stage(job, range(sent, len(dst)), n - (len(dst) - 1) * page_size)
            for transfer in job.transfers:  # earlier chunks land before the notifying write
                await wait(transfer, deadline)
            if faults.delay_kv_ready:
                await anyio.sleep(faults.delay_kv_ready)
            notif = None if faults.drop_kv_ready else ready.SerializeToString()
            final = self._write(job, range(sent, len(dst)), dst, notif)
            await wait(final, deadline)
            descriptors = sum(t.descriptors for t in job.transfers)
            transfer_span.set_attributes({"pdmesh.kv.status": "ok",
                                          "pdmesh.kv.descriptors": descriptors,
                                          "pdmesh.kv.gbps": final.gbps or 0.0})
        room.transition(RoomState.SUCCESS, time.monotonic())
        elapsed = time.perf_counter() - started
        result = cpb.TransferResult(
            key=info.key,
            status=cpb.TRANSFER_OK,
            first_token=first,
            pages_written=moved_pages,
            bytes_written=wire_bytes,
            cached_tokens=first_chunk,
            computed_tokens=n - first_chunk,
            bytes_skipped=skipped_bytes,
            transfer_seconds=elapsed,
            prefill=self.ref(),
            decode=info.decode,
            first_logprob=first_logprob,
            prompt_logprobs=prompt_logprobs,
        )
        self.metrics.transfer_seconds.observe(elapsed)
        self.metrics.transfer_tail_seconds.observe(time.perf_counter() - tail_started)
        self.metrics.transfer_bytes.observe(result.bytes_written)
        self.metrics.transfer_bytes_skipped.observe(skipped_bytes)
        self.counters.kv_bytes_moved_total += wire_bytes
        self.counters.kv_bytes_skipped_total += skipped_bytes
        self.metrics.transfer_descriptors.observe(descriptors)
        if final.gbps is not None:
            self.metrics.transfer_gbps.observe(final.gbps)
        if faults.delay_transfer_result:
            await anyio.sleep(faults.delay_transfer_result)
        if not faults.drop_transfer_result:
            await context.write(ppb.PrefillEvent(result=result))

    @staticmethod
    async def _prompt_logprobs(logits, tokens: list[int], start: int,
                               sampling) -> list[cpb.TokenLogprob]:
        """The logprobs of the prompt tokens a chunk's rows predict (tokens start+1..),
        off the loop: a log-softmax over the vocabulary per prompt token."""
        # The last chunk's last row predicts the first generated token, no prompt token.
        targets = tokens[start + 1 : start + len(logits) + 1]
        top = [sampling.top_logprobs] * len(targets)
        lps = await anyio.to_thread.run_sync(token_logprobs, logits[: len(targets)],
                                             targets, top)
        return [logprob_to_proto(lp) for lp in lps]

    async def _stage(self, job: Job, pages: range, last_page_tokens: int | None) -> None:
        """nvfp4: quantize these KV pages into their staging slots, off the event loop.

        Not abandoned on cancel: the thread finishes before the request's release can free
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
        if not pages:  # the decode holds every page: the KvReady travels alone
            agent = self.member.agent
            transfer = agent.notify(job.peer.agent_name, notif) if notif else Notified()
            job.transfers.append(transfer)
            job.room.transition(RoomState.TRANSFERRING, time.monotonic())
            return transfer
        src = [job.pages[i] for i in pages]
        dst_pages = [dst[i] for i in pages]
        transfer = self.member.agent.write_pages(
            job.peer.agent_name, job.peer.layout, src, dst_pages, notif
        )
        job.transfers.append(transfer)
        job.room.transition(RoomState.TRANSFERRING, time.monotonic())
        return transfer

    async def _release(self, job: Job) -> str:
        """Fence every posted write, then give the local pages back.

        A write still reading our pages must finish (or fail) before the pages
        can hold another request's KV; the deadline on the fence is the peer's
        problem to report, ours is never to reuse a page that may be read.
        """
        fenced = False
        deadline = time.monotonic() + TIMEOUTS.fence_seconds  # one budget for all: the caller's
        try:  # bound must never cut the bookkeeping below short
            fenced = all([await fence(t, max(0.0, deadline - time.monotonic()))
                          for t in job.transfers])  # a list: every write is fenced
        finally:  # whatever a fence raised, the room ends; only unfenced pages are kept
            if fenced:
                pool = self.member.pool
                if job.room.state is RoomState.SUCCESS:  # every page computed, writes fenced
                    pool.seal(job.pages)
                    pool.publish(job.tokens, job.pages)
                pool.free(job.pages)
            else:
                log.error("room %s: writes not fenced; %d pages withheld",
                          job.key, len(job.pages))
                for transfer in job.transfers:  # kept with the pages, not leaked
                    transfer.withheld = not transfer.released
                self.withheld.append(Withheld(job.key, job.pages, job.transfers))
            self.table.remove(job.key)
            self.requests.pop(job.key, None)
            self.ended.add(job.key)
            job.released.set()
        return "released"

    # ---- aborts and peers --------------------------------------------------------

    async def _stop(self, job: Job, reason: FailureCause, abort: cpb.Abort) -> None:
        if self.member.faults.delay_abort:
            await anyio.sleep(self.member.faults.delay_abort)
        job.cancel(reason, abort.stage)

    def on_peer_lost(self, member: bpb.Member, reason: str) -> None:
        """A decode left: its rooms fail at once instead of waiting for a timeout."""
        lost = cpb.PeerRef(name=member.name, epoch=member.epoch)
        for job in list(self.requests.values()):
            if job.peer_ref == lost:
                job.cancel(FailureCause.PEER_LOST)


async def fence(transfer, seconds: float) -> bool:
    """True once `transfer` can no longer touch memory: finished, failed, or cancelled."""
    try:
        await wait(transfer, time.monotonic() + seconds)
    except TransferError:
        pass
    return transfer.release()
