"""One request through the mesh, owned from start to end by the router.

The request flow (router-orchestrated push):
1. mint (room, generation), pick a pair;
2. open Decode.Generate: its first message is the TransferInfo (destination pages);
3. open Prefill.Prefill with that TransferInfo and read it to its TransferResult;
4. relay Decode's tokens until its Finish, or, when the decode preempted the
   request (its pool ran dry), re-run the rest on a pair with room
   (services/router/resume.py); the client's stream only pauses.

Whatever ends the request early (client gone, error, deadline), the finally
block cancels both calls (RST_STREAM) and sends shielded, bounded,
idempotent Aborts: first to the prefill, whose AbortAck says its writes are
fenced, then to the decode, told whether the writer is fenced so its
quarantined pages can come back at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from libs.member.timeouts import TIMEOUTS
from libs.rpc.calls import unary
from libs.tracing import mark_aborted, outgoing_metadata, span
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import prefill_pb2 as ppb
from services.router.admission import AdmissionQueue, QueueFull, QueueTimeout, Ticket
from services.router.pairing import NoPair, Pair, Pairing
from services.router.resume import DEFAULT_MAX_PREEMPTIONS, Preempted, continuation

log = logging.getLogger(__name__)

# A member lost or unreachable, or one that does not (yet) know its partner's epoch
# (a registration race after a restart): another attempt may well succeed.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


class MeshError(Exception):
    """The mesh failed this request; `code` is the gRPC status that best describes it."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 pair: Pair | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.code = code
        self.pair = pair  # the attempt's pair, when one was picked
        self.retry_after = retry_after  # seconds, for a refusal the client may retry


@dataclass
class Tokens:
    token_ids: list[int]
    text: str
    # With sampling.logprobs, one per token id; the prompt's (tokens 1..) ride on the
    # first Tokens of a request that asked for sampling.prompt_logprobs.
    logprobs: list[cpb.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[cpb.TokenLogprob] | None = None


@dataclass
class Finished:
    finish_reason: str
    completion_tokens: int


def _reason_for(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
        return "peer_lost"
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ALREADY_EXISTS,
    ):
        return "rejected"
    return "internal"


@dataclass
class Progress:
    """Where a request is, for its trace: the stage an abort happened in, and why."""

    stage: str = "queued"  # queued | prefill | transfer | decode
    room: str = ""  # hex of the current attempt's room id
    abort_reason: str | None = None
    preemptions: int = 0  # times a decode preempted it (each followed by a re-run)


def _task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class RoomMinter:
    """A room id is the router's own 8-byte tag (a hash of its member name) followed by 8
    random bytes: routers driving the same members can never mint one another's rooms,
    whatever their random draws, and one router's ids are random among themselves.
    Generations count up from the boot time."""

    def __init__(self, router: str = "router") -> None:
        self._generation = time.time_ns()
        self.tag = router_tag(router)

    def mint(self) -> cpb.RoomKey:
        self._generation += 1
        return cpb.RoomKey(room=self.tag + secrets.token_bytes(8), generation=self._generation)


def router_tag(router: str) -> bytes:
    """The first 8 bytes of every room id `router` mints."""
    return hashlib.blake2b(router.encode(), digest_size=8).digest()


class MeshClient:
    def __init__(self, pairing: Pairing, default_budget: float = 300.0, retries: int = 1,
                 on_retry=lambda: None, queue: AdmissionQueue | None = None,
                 on_queued=lambda seconds: None,
                 max_preemptions: int = DEFAULT_MAX_PREEMPTIONS, on_rerun=lambda: None,
                 router: str = "router"):
        self.pairing = pairing
        self.on_retry = on_retry
        self.on_queued = on_queued  # each request's time in the queue (0 when none)
        self.max_preemptions = max_preemptions
        self.on_rerun = on_rerun
        self.minter = RoomMinter(router)
        self.default_budget = default_budget
        self.retries = retries
        self.queue = queue or AdmissionQueue(max_queue=1024, timeout=default_budget)
        self.aborts: dict[str, int] = {}

    async def generate(
        self, prompt: list[int], sampling: cpb.SamplingParams, budget: float | None = None,
        progress: Progress | None = None,
    ) -> AsyncIterator[Tokens | Finished]:
        """Run one request; yields Tokens then one Finished, or raises MeshError.

        A decode that preempts the request ends its attempt with `Preempted` after the
        last token it sampled; the request then goes on as its continuation (prompt +
        the tokens streamed, the rest of max_tokens, the sampling step where it paused),
        so the caller sees one stream and one Finished counting every token. Each run
        is admitted like a new request (`_serve`).
        """
        budget = min(budget, self.default_budget) if budget else self.default_budget
        deadline = time.monotonic() + budget
        progress = progress or Progress()
        streamed: list[int] = []
        while True:
            rest_prompt, rest_sampling = continuation(prompt, sampling, streamed)
            ran: list[int] = []  # this run's tokens
            preempted: Preempted | None = None
            async with aclosing(self._serve(rest_prompt, rest_sampling, deadline,
                                            progress)) as events:
                async for event in events:
                    if isinstance(event, Preempted):  # the run's last event
                        preempted = event
                        continue
                    if isinstance(event, Tokens):
                        ran.extend(event.token_ids)
                    elif isinstance(event, Finished):
                        event = Finished(event.finish_reason,
                                         len(streamed) + event.completion_tokens)
                    yield event
            if preempted is None:
                return
            if preempted.completion_tokens != len(ran):
                raise MeshError(f"the decode preempted the request after "
                                f"{preempted.completion_tokens} tokens but sent {len(ran)}",
                                grpc.StatusCode.INTERNAL)
            streamed += ran
            progress.preemptions += 1
            trace.get_current_span().add_event("preempted", {
                "pdmesh.preemptions": progress.preemptions,
                "pdmesh.completion_tokens": len(streamed)})
            if progress.preemptions > self.max_preemptions:
                raise MeshError(
                    f"preempted {progress.preemptions} times (--max-preemptions "
                    f"{self.max_preemptions}): the decodes' KV pools cannot hold it beside "
                    f"the other requests", grpc.StatusCode.ABORTED)
            self.on_rerun()
            log.info("request %s preempted after %d tokens; re-running the rest",
                     progress.room, len(streamed))

    async def _serve(
        self, prompt: list[int], sampling: cpb.SamplingParams, deadline: float,
        progress: Progress,
    ) -> AsyncIterator[Tokens | Finished | Preempted]:
        """One run of a request, or of a preempted request's continuation.

        Admission waits (services/router/admission.py): a run that arrives behind
        others joins the queue behind them, and one whose attempt was refused for
        capacity (RESOURCE_EXHAUSTED before any token) waits at its place in the queue
        and tries again; only a full queue (RESOURCE_EXHAUSTED, retry_after set) or a
        wait past its budget (UNAVAILABLE, or DEADLINE_EXCEEDED at the request's own
        deadline) ends it there. A refusal is not a retry: the retries below are for
        failures.

        An attempt that fails RETRYABLE (a peer lost, a transfer failed, a partner's
        epoch not yet known) before any token reached the caller is retried, on
        another pair if one exists, with a new room. The retry starts only once the
        failed attempt's legs were aborted and acknowledged: `_attempt` awaits its
        Aborts before it raises.
        """
        avoid: frozenset[str] = frozenset()
        ticket: Ticket | None = None
        reserved_at: float | None = None
        # One span for a stay in the queue, from joining it to the pages' reservation
        # (its tries, each a refused `decode call`, are its siblings).
        waiting: Span | None = None

        def reserved() -> None:
            """The decode holds the request's pages: out of the queue, the next may try."""
            nonlocal reserved_at, waiting
            reserved_at = time.monotonic()
            if ticket is not None:
                self.queue.leave(ticket)
            if waiting is not None:
                waiting.end()
                waiting = None

        async def wait_turn() -> None:
            nonlocal ticket, waiting
            ticket = self._join(ticket, progress)
            if waiting is None:
                waiting = trace.get_tracer("pdmesh").start_span(
                    "queue wait", attributes={"pdmesh.queue.depth": self.queue.depth})
            await self._wait(ticket, deadline, progress, waiting)

        try:
            if self.queue.busy():  # others wait for capacity: behind them, not before
                await wait_turn()
            failures = 0
            while True:
                yielded = False
                try:
                    # aclosing: a caller that leaves while we sit at `yield` closes the
                    # attempt here, in its own task, so its Aborts are sent now; a bare
                    # `async for` would leave them to the garbage collector's finalizer,
                    # detached and late.
                    async with aclosing(
                        self._attempt(prompt, sampling, deadline, avoid, progress, reserved)
                    ) as events:
                        async for event in events:
                            yielded = True
                            yield event
                    return
                except MeshError as e:
                    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not yielded:
                        await wait_turn()
                        continue
                    retry = (
                        not yielded
                        and failures < self.retries
                        and e.code in RETRYABLE
                        and e.pair is not None
                        and time.monotonic() < deadline
                    )
                    if not retry:
                        raise
                    failures += 1
                    self.on_retry()
                    avoid = frozenset({e.pair.prefill.member.name, e.pair.decode.member.name})
                    log.warning("retrying after %s (attempt %d)", e, failures)
        finally:
            if ticket is not None:
                self.queue.leave(ticket)
            if waiting is not None:  # it left while queued: waiting, or during a try
                mark_aborted(waiting, progress.abort_reason or "client_disconnect", "queued")
                waiting.end()
            # in the queue: from joining it to the pages' reservation (or to leaving)
            self.on_queued(0.0 if ticket is None
                           else (reserved_at or time.monotonic()) - ticket.entered)

    def _join(self, ticket: Ticket | None, progress: Progress) -> Ticket:
        try:
            return self.queue.join(ticket)
        except QueueFull as e:
            progress.abort_reason = "rejected"
            self._count_abort("rejected")
            raise MeshError(str(e), grpc.StatusCode.RESOURCE_EXHAUSTED,
                            retry_after=e.retry_after) from None

    async def _wait(self, ticket: Ticket, deadline: float, progress: Progress,
                    waiting: Span) -> None:
        """Wait for the ticket's turn; a client that leaves here leaves only the queue:
        none of its attempts holds anything on a member (a refused one never did, an
        earlier one's Aborts were answered before it raised)."""
        progress.stage, progress.abort_reason = "queued", None
        try:
            await self.queue.wait_turn(ticket, deadline)
        except QueueTimeout as e:
            progress.abort_reason = "deadline"
            self._count_abort("deadline")
            if e.deadline:
                raise MeshError(str(e), grpc.StatusCode.DEADLINE_EXCEEDED) from None
            raise MeshError(str(e), grpc.StatusCode.UNAVAILABLE,
                            retry_after=e.retry_after) from None
        except anyio.get_cancelled_exc_class():
            progress.abort_reason = "client_disconnect"
            self._count_abort("client_disconnect")
            waiting.add_event("cancelled")  # between tries: no member holds anything of it
            raise

    def _count_abort(self, reason: str) -> None:
        self.aborts[reason] = self.aborts.get(reason, 0) + 1

    async def _attempt(
        self, prompt: list[int], sampling: cpb.SamplingParams, deadline: float,
        avoid: frozenset[str], progress: Progress, reserved: Callable[[], None],
    ) -> AsyncIterator[Tokens | Finished | Preempted]:
        key = self.minter.mint()
        progress.room, progress.stage = key.room.hex(), "queued"
        try:
            with span("pair selection"):
                pair = self.pairing.pick(avoid, prompt)
        except NoPair as e:
            raise MeshError(str(e), grpc.StatusCode.UNAVAILABLE) from None
        with pair:
            legs = _Legs(pair, key, progress, reserved, self.queue.capacity_freed)
            pair.prefill.requests.add(legs)
            pair.decode.requests.add(legs)
            reason = "internal"
            exhausted = False  # refused for capacity: the request queues, it is not aborted
            try:
                async with aclosing(legs.run(prompt, sampling, deadline)) as events:
                    async for event in events:
                        yield event
                return
            except grpc.aio.AioRpcError as e:
                if legs.lost is not None:
                    reason = "peer_lost"
                    raise MeshError(legs.lost, grpc.StatusCode.UNAVAILABLE, pair) from None
                reason = _reason_for(e.code())
                exhausted = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                raise MeshError(f"{e.code().name}: {e.details()}", e.code(), pair) from None
            except MeshError as e:
                e.pair = pair
                raise
            except (anyio.get_cancelled_exc_class(), GeneratorExit):
                if legs.lost is not None and not _task_cancelling():
                    # our own call.cancel() from lose(), not the task being cancelled
                    reason = "peer_lost"
                    raise MeshError(legs.lost, grpc.StatusCode.UNAVAILABLE, pair) from None
                reason = "client_disconnect"
                raise
            finally:
                pair.prefill.requests.discard(legs)
                pair.decode.requests.discard(legs)
                # A decode that refused at admission holds nothing and was never joined by
                # a prefill: nothing to abort, and no capacity came back.
                if not legs.finished and not legs.refused:
                    if not exhausted:
                        self._count_abort(reason)
                    progress.abort_reason = reason
                    with anyio.move_on_after(TIMEOUTS.abort_seconds, shield=True):
                        await legs.abort(reason)
                legs.end_decode_span()
                if not legs.refused:
                    self.queue.capacity_freed()


class _Legs:
    """The two calls of one request and how to cancel them."""

    def __init__(self, pair: Pair, key: cpb.RoomKey, progress: Progress,
                 reserved: Callable[[], None], prefill_freed: Callable[[], None]):
        self.pair = pair
        self.key = key
        self.progress = progress
        self.reserved = reserved  # the decode reserved the pages (its TransferInfo came)
        self.prefill_freed = prefill_freed  # the prefill's pages came back
        self.refused = False  # the decode refused at admission: it holds nothing
        self.decode_span: Span | None = None
        self.decode_call = None
        self.prefill_call = None
        self.prefill_done = False
        self.finished = False
        self.lost: str | None = None  # why, once a member of the pair left mid-request
        # every member of the pair that left: its channel is retired, never to be called
        self.lost_members: set[str] = set()

    def lose(self, member: str, reason: str) -> None:
        """A member of this request's pair left: end both calls now (W5), not at a timeout."""
        if self.lost is None:
            self.lost = f"{member} left the mesh ({reason})"
        self.lost_members.add(member)
        for call in (self.prefill_call, self.decode_call):
            if call is not None:
                call.cancel()

    def end_decode_span(self) -> None:
        if self.decode_span is not None:
            if self.refused:  # not an abort: the request waits in the queue and tries again
                self.decode_span.set_status(Status(StatusCode.ERROR, "refused for capacity"))
            elif not self.finished:
                mark_aborted(self.decode_span, self.progress.abort_reason or "internal",
                             self.progress.stage)
            self.decode_span.end()
            self.decode_span = None

    async def run(self, prompt, sampling, deadline
                  ) -> AsyncIterator[Tokens | Finished | Preempted]:
        pair, key, progress = self.pair, self.key, self.progress
        # The decode call lives as long as the request: its span is ended by the owner
        # (end_decode_span), the prefill call's span is a sibling under the request.
        self.decode_span = trace.get_tracer("pdmesh").start_span(
            "decode call", kind=SpanKind.CLIENT,
            attributes={"pdmesh.member": pair.decode.member.name,
                        "pdmesh.request.id": key.room.hex()},
        )
        self.decode_call = pair.decode.stub.Generate(
            dpb.DecodeRequest(
                key=key, prompt_tokens=len(prompt), sampling=sampling, prefill=pair.prefill.ref,
                prompt_token_ids=prompt,
            ),
            timeout=deadline - time.monotonic(),
            metadata=outgoing_metadata(span=self.decode_span),
        )
        try:
            first = await self.decode_call.read()
        except grpc.aio.AioRpcError as e:
            # The call ended with the decode's own status before any TransferInfo: a
            # refusal at admission leaves nothing on it (libs/member/admission.py).
            self.refused = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            raise
        if first is grpc.aio.EOF or not first.HasField("transfer"):
            raise MeshError("decode did not answer with a TransferInfo", grpc.StatusCode.INTERNAL)
        self.reserved()
        result = None
        with span("prefill call", kind=SpanKind.CLIENT,
                  attributes={"pdmesh.member": pair.prefill.member.name,
                              "pdmesh.request.id": key.room.hex()}):
            self.prefill_call = pair.prefill.stub.Prefill(
                ppb.PrefillRequest(
                    key=key, prompt_tokens=prompt, sampling=sampling, transfer=first.transfer
                ),
                timeout=deadline - time.monotonic(),
                metadata=outgoing_metadata(),
            )
            async for event in self.prefill_call:
                if event.HasField("result"):
                    result = event.result
                elif event.progress.tokens_done < len(prompt):
                    progress.stage = "prefill"  # out of the prefill's queue, computing
                else:
                    progress.stage = "transfer"
            if result is not None:  # the prefix caches' share of this prompt, for the trace
                held = first.transfer.held_pages * pair.decode.member.layout.page_size
                trace.get_current_span().set_attributes({
                    "pdmesh.prompt.cached_tokens": result.cached_tokens,
                    "pdmesh.prompt.computed_tokens": result.computed_tokens,
                    "pdmesh.kv.moved_tokens": max(0, len(prompt) - held),
                    "pdmesh.kv.held_tokens": min(held, len(prompt)),
                })
        if result is None or result.status != cpb.TRANSFER_OK:
            why = result.error if result is not None else "no TransferResult"
            raise MeshError(f"prefill failed: {why}")
        if result.prefill != pair.prefill.ref or result.decode != pair.decode.ref:
            raise MeshError(
                f"TransferResult names {result.prefill.name}/{result.prefill.epoch} -> "
                f"{result.decode.name}/{result.decode.epoch}, not this request's pair",
                grpc.StatusCode.INTERNAL,
            )
        self.prefill_done = True
        self.prefill_freed()
        progress.stage = "transfer"
        # The prefill says every page was written; a decode that still sees no KvReady
        # after the grace is a lost notification, reported as one, not a 300 s hang.
        arrived = None
        with anyio.move_on_after(TIMEOUTS.kv_arrival_grace):
            arrived = await self.decode_call.read()
        if arrived is None:
            raise MeshError(
                f"the prefill wrote the KV but the decode saw no KvReady within "
                f"{TIMEOUTS.kv_arrival_grace:.0f} s", grpc.StatusCode.UNAVAILABLE,
            )
        if arrived is grpc.aio.EOF or not arrived.HasField("kv_arrived"):
            raise MeshError("decode did not confirm the KV's arrival", grpc.StatusCode.INTERNAL)
        progress.stage = "decode"
        # The prefill sampled the first token: its logprob came in the TransferResult.
        first_logprobs = [result.first_logprob] if result.HasField("first_logprob") else []
        prompt_logprobs = list(result.prompt_logprobs) if sampling.prompt_logprobs else None
        while True:
            event = await self.decode_call.read()
            if event is grpc.aio.EOF:
                raise MeshError("decode ended without a Finish", grpc.StatusCode.INTERNAL)
            if event.HasField("tokens"):
                logprobs = [*first_logprobs, *event.tokens.logprobs]
                yield Tokens(list(event.tokens.token_ids), event.tokens.text, logprobs,
                             prompt_logprobs)
                first_logprobs, prompt_logprobs = [], None
            elif event.HasField("finish"):
                self.finished = True
                yield Finished(event.finish.finish_reason, event.finish.completion_tokens)
                return
            elif event.HasField("preempted"):
                # The decode released the sequence (its KV had landed: no write can touch
                # the pages) and the prefill is done: nothing is left to abort.
                self.finished = True
                self.decode_span.add_event("preempted", {
                    "pdmesh.completion_tokens": event.preempted.completion_tokens})
                yield Preempted(event.preempted.completion_tokens)
                return

    async def abort(self, reason: str) -> None:
        """Abort (with the reason) before cancelling the calls, so each member records
        why its leg ended, not just that its caller left; the calls are cancelled
        whatever the Aborts' outcome."""
        try:
            with span("abort", attributes={"pdmesh.abort.reason": reason,
                                           "pdmesh.abort.stage": self.progress.stage}):
                await self._send_aborts(reason)
        finally:
            for call in (self.prefill_call, self.decode_call):
                if call is not None:
                    call.cancel()

    async def _send_aborts(self, reason: str) -> None:
        fenced = self.prefill_done
        # A writer that left is not asked: its epoch ending is the decode's fence.
        if not fenced and self.pair.prefill.member.name not in self.lost_members:
            try:
                ack = await unary(
                    self.pair.prefill.stub.Abort,
                    cpb.Abort(key=self.key, reason=reason, prefill=self.pair.prefill.ref,
                              decode=self.pair.decode.ref, stage=self.progress.stage),
                    timeout=TIMEOUTS.abort_seconds,
                )
                fenced = ack.released
                trace.get_current_span().add_event(
                    "AbortAck", {"pdmesh.member": self.pair.prefill.member.name,
                                 "pdmesh.released": ack.released})
            except grpc.aio.AioRpcError as e:
                log.warning("Abort to prefill failed: %s", e.code().name)
        if self.pair.decode.member.name in self.lost_members:
            return  # nobody left to tell
        try:
            ack = await unary(
                self.pair.decode.stub.Abort,
                cpb.Abort(key=self.key, reason=reason, writer_fenced=fenced,
                          prefill=self.pair.prefill.ref, decode=self.pair.decode.ref,
                          stage=self.progress.stage),
                timeout=TIMEOUTS.abort_seconds,
            )
            trace.get_current_span().add_event(
                "AbortAck", {"pdmesh.member": self.pair.decode.member.name,
                             "pdmesh.released": ack.released})
        except grpc.aio.AioRpcError as e:
            log.warning("Abort to decode failed: %s", e.code().name)
