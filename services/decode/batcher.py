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

Where a step's time goes is kept as running totals (`step_seconds`, exported as
`pdmesh_decode_step_seconds_total{part}`), in the order a step spends it:

- prepare: the event loop admits waiting sequences, grows pages, builds the batch;
- dispatch: until the compute thread starts the step;
- compute: the step on the compute thread (launches, the forward, sampling, the copy back);
- resume: until the event loop runs the batch loop again (behind whatever else it had);
- handoff: the event loop hands each token to its stream and retires finished sequences.

On a GPU only compute is the device's: the rest is host time the device waits through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from libs.engine.engine import DecodeSeq, Engine
from libs.engine.logprobs import TokenLogprob, token_logprobs
from libs.engine.sampling import BatchSampling, SamplingParams, request_seed, sample_batch
from libs.member.loop import ComputeLoop
from libs.member.timeouts import TIMEOUTS
from services.decode.growth import grow

log = logging.getLogger(__name__)

STEP_PARTS = ("prepare", "dispatch", "compute", "resume", "handoff")  # in a step's order


@dataclass(frozen=True, slots=True)
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
    send: MemoryObjectSendStream[Sampled]
    receive: MemoryObjectReceiveStream[Sampled]
    generated: int = 0
    last_token: int = 0
    history: list[int] = field(default_factory=list)  # every accepted token, in order
    cancelled: bool = False
    finished: bool = False
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


class Batcher(ComputeLoop):
    def __init__(self, engine: Engine, eos_token_ids: Iterable[int], max_batch: int = 64,
                 stall_after: float = TIMEOUTS.decode_stall_seconds, stall_step: float = 0.0):
        super().__init__(stall_after)
        self.engine = engine
        self.stall_step = stall_step  # fault injection: a step slower than a release's bound
        self.eos_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.steps = 0
        self.step_seconds = dict.fromkeys(STEP_PARTS, 0.0)
        self.preemptions = 0
        self._admitted = 0

    def admit(self, pages, prompt_len: int, first_token: int, params: SamplingParams) -> Sequence:
        # every token of a sequence (and the error) fits: send_nowait never blocks the step
        send, receive = anyio.create_memory_object_stream[Sampled](params.max_tokens + 2)
        end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        seq = Sequence(
            pages=pages,
            prompt_len=prompt_len,
            params=params,
            seed=request_seed(params),
            end_ids=frozenset(end_ids),
            send=send,
            receive=receive,
            order=self._admitted,
        )
        self._admitted += 1
        sampled = seq.accept(first_token)  # sampled by the prefill
        send.send_nowait(sampled)
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
        # a running sequence leaves at the end of the step in progress (or now if idle)
        elif seq in self.running and not self._stepping:
            self.running.remove(seq)
            self._finish(seq)

    _stepping = False

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    async def run(self) -> None:
        """Run forever: the one owner of the batch."""
        while True:
            await self.until_busy()
            started = time.perf_counter()
            room = self.max_batch - len(self.running)
            self.running.extend(self.waiting[:room])
            del self.waiting[:room]
            self._grow()
            if not self.running:
                continue
            try:
                await self._step(started)
            except Exception:  # contained: the batch fails, the loop lives on
                log.exception("decode step failed; failing %d sequences", len(self.running))
                for seq in self.running:
                    seq.send.send_nowait(Sampled(-1, "error"))
                    self._finish(seq)
                self.running.clear()

    def _grow(self) -> None:
        """Between steps: pages for every running sequence's next token, newest preempted
        first when the pool is short; a preempted sequence's stream ends "preempted"."""
        for seq in grow(self.engine.pool, self.running, self.waiting):
            (self.running if seq in self.running else self.waiting).remove(seq)
            self.preemptions += 1
            seq.send.send_nowait(Sampled(-1, "preempted"))
            self._finish(seq)

    async def _step(self, started: float) -> None:
        running = list(self.running)
        batch = [
            DecodeSeq(pages=s.pages, pos=s.prompt_len + s.generated - 1, token=s.last_token)
            for s in running
        ]
        self._stepping = True
        dispatched = time.perf_counter()
        try:
            (tokens, logprobs), entered, left = await anyio.to_thread.run_sync(
                self._timed_decode, batch, running)
        finally:
            self._stepping = False
        resumed = time.perf_counter()
        self.steps += 1
        self.progressed()
        for i, (seq, token) in enumerate(zip(running, tokens, strict=True)):
            if seq.cancelled:
                self.running.remove(seq)
                self._finish(seq)
                continue
            sampled = seq.accept(token, logprobs.get(i))
            seq.send.send_nowait(sampled)
            if sampled.finish_reason is not None:
                self.running.remove(seq)
                self._finish(seq)
        marks = (started, dispatched, entered, left, resumed, time.perf_counter())
        for part, begin, end in zip(STEP_PARTS, marks, marks[1:], strict=False):
            self.step_seconds[part] += end - begin

    def _timed_decode(self, batch: list[DecodeSeq], seqs: list[Sequence]):
        """`_decode`, with the compute thread's start and end times."""
        entered = time.perf_counter()
        return self._decode(batch, seqs), entered, time.perf_counter()

    def _decode(
        self, batch: list[DecodeSeq], seqs: list[Sequence]
    ) -> tuple[list[int], dict[int, TokenLogprob]]:
        """On the compute thread: the forward pass, the batch's sampling, one copy back;
        and the logprobs of the rows that asked for them (one more copy, only then).

        Token k of a sequence is drawn with step start_step + k (the prefill drew
        start_step, 0 unless this is a preempted request's re-run), so its stream is the
        one a colocated, unpreempted run would sample.
        """
        if self.stall_step:
            time.sleep(self.stall_step)  # blocks the compute thread, as a starved host would
        sampling = BatchSampling.build(
            [s.params for s in seqs], [s.seed for s in seqs],
            [s.params.start_step + s.generated for s in seqs], self.engine.device,
        )
        logits = self.engine.decode_step(batch)
        tokens = sample_batch(logits, sampling)
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs]
        if not rows:
            return tokens.tolist(), {}
        index = torch.tensor(rows, device=logits.device)
        found = token_logprobs(logits[index], tokens[index],
                               [seqs[i].params.top_logprobs for i in rows])
        return tokens.tolist(), dict(zip(rows, found, strict=True))

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        seq.send.close()
        seq.released.set()
