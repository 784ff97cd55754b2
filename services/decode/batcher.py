"""Continuous batching: every admitted sequence advances one token per step.

One task owns the batch. Each step runs the batched forward pass and samples the whole
batch on the compute thread (the event loop never blocks on it), with one device-to-host
copy of the sampled ids; EOS, stop tokens and max_tokens are checked on the host from that
list, and each token goes to its sequence's own stream. Detokenizing and stop strings are
the stream reader's work (`services/decode/stream.py`), done on the event loop while the
next step computes. A sequence leaves the batch when it finishes, is cancelled or is
preempted; its `released` event tells the owner that no step can touch its pages any
more, so they may be freed.

Before each step the batch grows its sequences' pages as they need them, preempting the
newest when the pool runs dry (`services/decode/growth.py`).

Overlapped steps (`--overlap-steps`, on by default for CUDA). Serially, the device idles while
the host hands a step's tokens to their streams, serves the streams and plans the next
step. With overlap, step N+1 is launched before step N is handed off: its rows feed the
tokens step N sampled straight from the device (a token -(j+1) names row j of step N's
ids, `Engine.decode_step`), the compute thread then waits for step N's ids alone
(`libs/engine/host_tokens.py`), and the event loop hands them off while the device runs
step N+1. What that costs, and how it stays safe:

- a sequence that samples EOS (or is cancelled) in step N is already in step N+1, which
  writes its KV one position on: its stream ends at once, but it is `released` only when
  step N+1 is handed off, and step N+1's token for it is dropped;
- a sequence whose max_tokens is reached by the step in flight is left out of the next;
- preemption frees pages at once, so it happens only with no step on the device: when
  the pool is short with one in flight, that step is handed off first;
- a step whose rows want logprobs reads them on the compute thread (a host sync), so it
  does not overlap.

Where a step's time goes is kept as running totals (`step_seconds`, exported as
`pdmesh_decode_step_seconds_total{part}`), in the order a step spends it:

- prepare: the event loop admits waiting sequences, grows pages, builds the batch;
- dispatch: until the compute thread starts the step;
- compute: the step on the compute thread: launches, sampling, and the wait for the ids
  handed off (serially this step's, with overlap the step before's);
- resume: until the event loop runs the batch loop again (behind whatever else it had);
- handoff: the event loop hands each token to its stream and retires finished sequences.

On a GPU only the device's share of compute is the device's: serially the rest is host
time the device waits through; with overlap the device runs the next step meanwhile, so
a step costs the longer of the two, not their sum.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import anyio
import torch

from libs.engine.engine import DecodeSeq, Engine
from libs.engine.host_tokens import HostTokens, Pending
from libs.engine.logprobs import TokenLogprob, token_logprobs
from libs.engine.sampling import BatchSampling, SamplingParams, request_seed, sample_batch
from libs.member.loop import ComputeLoop
from libs.member.timeouts import TIMEOUTS
from services.decode.growth import grow, grow_if_it_fits
from services.decode.token_queue import TokenQueue

log = logging.getLogger(__name__)

STEP_PARTS = ("prepare", "dispatch", "compute", "resume", "handoff")  # in a step's order


@dataclass(slots=True)  # 128 a step at 128 streams: not frozen, whose __init__ is 3x slower
class Sampled:
    """One token a step sampled for a sequence, as its stream receives it.

    ``finish_reason`` is set on the sequence's last item: "stop" on an EOS or stop token
    (which has no text of its own), "length" on the last token max_tokens allows, "error"
    (with no token) when the step failed, "preempted" (with no token) when the batch took
    its pages back for older sequences. ``logprob`` is set when the request asked for
    logprobs, except on the prefill's first token (the router has that one).
    """

    token: int
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None


@dataclass(eq=False)
class Sequence:
    # The owner's list: growth appends to it, a preemption frees and empties it, so the
    # owner's release frees exactly what is left (services/decode/growth.py).
    pages: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    end_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop tokens
    tokens: TokenQueue[Sampled]  # to the sequence's stream reader
    generated: int = 0
    last_token: int = 0
    history: list[int] = field(default_factory=list)  # every accepted token, in order
    cancelled: bool = False
    finished: bool = False
    ahead: int = 0  # tokens launched on the device, not handed off yet (0..2)
    row: int = 0  # its row in the last step launched
    order: int = 0  # admission order, for newest-first preemption
    released: anyio.Event = field(default_factory=anyio.Event)

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> Sampled:
        """Record one sampled token; returns what its stream receives."""
        self.generated += 1
        self.last_token = token
        self.history.append(token)
        if token in self.end_ids:
            return Sampled(token, "stop", logprob)
        if self.generated >= self.params.max_tokens:
            return Sampled(token, "length", logprob)
        return Sampled(token, None, logprob)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step as the event loop planned it, for the compute thread to launch."""

    seqs: list[Sequence]
    rows: list[DecodeSeq]
    steps: list[int]  # each row's sampling step
    fed: torch.Tensor | None  # the step on the device's sampled ids, which rows may feed


@dataclass(eq=False)
class Launch:
    """A step on the device: its sequences in row order, its sampled ids (on the device,
    which the next step may feed) and their copy to the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] on the engine's device
    host: Pending
    logprobs: dict[int, TokenLogprob]  # by row, for the rows that asked


class Batcher(ComputeLoop):
    def __init__(self, engine: Engine, eos_token_ids: Iterable[int], max_batch: int = 64,
                 stall_after: float = TIMEOUTS.decode_stall_seconds, stall_step: float = 0.0,
                 overlap: bool = False):
        """overlap: launch each step before handing off the one before (for CUDA, where
        a launch does not wait for the device)."""
        super().__init__(stall_after)
        self.engine = engine
        self.stall_step = stall_step  # fault injection: a step slower than a release's bound
        self.eos_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch
        self.overlap = overlap
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.steps = 0
        self.step_seconds = dict.fromkeys(STEP_PARTS, 0.0)
        self.preemptions = 0
        self._admitted = 0
        self._host_tokens = HostTokens()

    def admit(self, pages, prompt_len: int, first_token: int, params: SamplingParams) -> Sequence:
        end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        seq = Sequence(
            pages=pages,
            prompt_len=prompt_len,
            params=params,
            seed=request_seed(params),
            end_ids=frozenset(end_ids),
            tokens=TokenQueue(),
            order=self._admitted,
        )
        self._admitted += 1
        sampled = seq.accept(first_token)  # sampled by the prefill
        seq.tokens.put(sampled)
        if sampled.finish_reason is not None:
            self._finish(seq)
        else:
            self.waiting.append(seq)
            self.wake()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Take a sequence out; `released` is set once no step can touch its pages."""
        seq.cancelled = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            self._finish(seq)
        # a sequence in a step leaves when that step is handed off (or now if it is in
        # none: `ahead` counts the steps launched with it and not handed off yet)
        elif seq in self.running and not seq.ahead:
            self.running.remove(seq)
            self._finish(seq)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    async def run(self) -> None:
        """Run forever: the one owner of the batch."""
        ahead: Launch | None = None  # with overlap: launched, its tokens not handed off
        while True:
            if ahead is None:
                await self.until_busy()
            started = time.perf_counter()
            batch = self._next_batch(can_preempt=ahead is None)
            if not batch and ahead is None:
                continue
            try:
                ahead = await self._step(batch, ahead, started)
            except Exception:  # contained: the batch fails, the loop lives on
                log.exception("decode step failed; failing %d sequences", len(self.running))
                await self._settle()
                self._fail(batch, ahead)
                ahead = None

    def _next_batch(self, can_preempt: bool) -> list[Sequence]:
        """The sequences the next step advances, their pages grown for it.

        Admits waiting sequences, retires cancelled ones, and leaves out those whose last
        token is already on the device. Preemption frees pages at once, so it happens
        only with no step on the device (``can_preempt``); when the pool is short with a
        step on the device, the batch is empty: that step is handed off first.
        """
        room = self.max_batch - len(self.running)
        self.running.extend(self.waiting[:room])
        del self.waiting[:room]
        for seq in [s for s in self.running if s.cancelled]:
            self.running.remove(seq)
            self._finish(seq)
        if can_preempt:
            self._grow()
            return list(self.running)
        batch = [s for s in self.running if s.generated + s.ahead < s.params.max_tokens]
        return batch if grow_if_it_fits(self.engine.pool, batch) else []

    def _grow(self) -> None:
        """With no step on the device: pages for every running sequence's next token,
        newest preempted first when the pool is short; a preempted sequence's stream ends
        "preempted"."""
        for seq in grow(self.engine.pool, self.running, self.waiting):
            (self.running if seq in self.running else self.waiting).remove(seq)
            self.preemptions += 1
            seq.tokens.put(Sampled(-1, "preempted"))
            self._finish(seq)

    async def _step(self, batch: list[Sequence], ahead: Launch | None,
                    started: float) -> Launch | None:
        """Launch ``batch``'s step and hand off the step before it (with overlap), or the
        step itself (without); returns the step left on the device, if any."""
        plan = self._plan(batch, ahead)
        for row, seq in enumerate(batch):
            seq.ahead += 1
            seq.row = row
        dispatched = time.perf_counter()
        (launched, done, tokens), entered, left = await anyio.to_thread.run_sync(
            self._timed_advance, plan, ahead)
        resumed = time.perf_counter()
        if launched is not None:
            self.steps += 1
        self.progressed()
        if done is not None:
            self._hand_off(done, tokens)
        marks = (started, dispatched, entered, left, resumed, time.perf_counter())
        for part, begin, end in zip(STEP_PARTS, marks, marks[1:], strict=False):
            self.step_seconds[part] += end - begin
        return launched if self.overlap else None

    def _plan(self, batch: list[Sequence], ahead: Launch | None) -> StepPlan | None:
        """On the event loop: what the compute thread needs to launch ``batch``.

        A sequence with a token on the device (``ahead``) feeds it from there: its row
        in ``ahead`` stands in for the id. Token k of a sequence is drawn with step
        start_step + k (the prefill drew start_step, 0 unless this is a preempted
        request's re-run), so its stream is the one a colocated, unpreempted run would
        sample.
        """
        if not batch:
            return None
        rows, steps = [], []
        for s in batch:
            fed = s.generated + s.ahead  # tokens sampled so far, the prefill's included
            token = -(s.row + 1) if s.ahead else s.last_token
            rows.append(DecodeSeq(pages=s.pages, pos=s.prompt_len + fed - 1, token=token))
            steps.append(s.params.start_step + fed)
        return StepPlan(batch, rows, steps, ahead.tokens if ahead is not None else None)

    def _timed_advance(self, plan: StepPlan | None, ahead: Launch | None):
        """`_advance`, with the compute thread's start and end times."""
        entered = time.perf_counter()
        return self._advance(plan, ahead), entered, time.perf_counter()

    def _advance(self, plan: StepPlan | None, ahead: Launch | None):
        """On the compute thread: launch the plan's step, then wait for the tokens of the
        step to hand off: the one before it with overlap (the device runs the new step
        meanwhile), the new one without."""
        launched = self._launch(plan) if plan is not None else None
        done = ahead if self.overlap else launched
        return launched, done, done.host.wait() if done is not None else None

    def _launch(self, plan: StepPlan) -> Launch:
        """The forward pass and the batch's sampling, queued on the device, and the copy of
        the sampled ids to the host; the logprobs of the rows that asked for them are read
        here (a host sync, so such a step does not overlap)."""
        if self.stall_step:
            time.sleep(self.stall_step)  # blocks the compute thread, as a starved host would
        seqs = plan.seqs
        sampling = BatchSampling.build([s.params for s in seqs], [s.seed for s in seqs],
                                       plan.steps, self.engine.device)
        logits = self.engine.decode_step(plan.rows, copy=False, fed=plan.fed)
        tokens = sample_batch(logits, sampling)
        host = self._host_tokens.start(tokens)
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs]
        logprobs: dict[int, TokenLogprob] = {}
        if rows:
            index = torch.tensor(rows, device=logits.device)
            found = token_logprobs(logits[index], tokens[index],
                                   [seqs[i].params.top_logprobs for i in rows])
            logprobs = dict(zip(rows, found, strict=True))
        return Launch(seqs, tokens, host, logprobs)

    def _hand_off(self, done: Launch, tokens: list[int]) -> None:
        """On the event loop: each token to its sequence's stream; a sequence that ended
        or was cancelled while the step ran drops its token, and is released once no
        step on the device holds it."""
        for row, (seq, token) in enumerate(zip(done.seqs, tokens, strict=True)):
            seq.ahead -= 1
            if seq.finished:  # ended during the step: nothing of it is read any more
                if not seq.ahead:
                    seq.released.set()
                continue
            if seq.cancelled:
                self.running.remove(seq)
                self._finish(seq)
                continue
            sampled = seq.accept(token, done.logprobs.get(row))
            seq.tokens.put(sampled)
            if sampled.finish_reason is not None:
                self.running.remove(seq)
                self._finish(seq)

    async def _settle(self) -> None:
        """After a failed step: wait until the device has run whatever was queued (the
        step before it may still be writing KV into pages about to be freed). A device
        that failed raises here at once: nothing more runs on it."""
        if torch.device(self.engine.device).type == "cuda":
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(torch.cuda.synchronize, self.engine.device)

    def _fail(self, batch: list[Sequence], ahead: Launch | None) -> None:
        """A step failed: every sequence of the batch ends with an error and is released."""
        for seq in {*batch, *(ahead.seqs if ahead is not None else ()), *self.running}:
            seq.ahead = 0
            if not seq.finished:
                seq.tokens.put(Sampled(-1, "error"))
                self._finish(seq)
            seq.released.set()
        self.running.clear()

    def _finish(self, seq: Sequence) -> None:
        """End the sequence's stream; release it unless a step on the device holds it."""
        seq.finished = True
        seq.tokens.close()
        if not seq.ahead:
            seq.released.set()
