"""Continuous batching: every admitted sequence advances one token per step.

One task owns the batch. Each step runs the batched forward pass on the
compute thread (the event loop never blocks on it), samples each sequence's
next token, detokenizes, checks EOS / stop strings / max_tokens, and hands
the result to the sequence's own bounded stream. A sequence leaves the batch
when it finishes or is cancelled; its `released` event tells the owner that
no step can touch its pages any more, so they may be freed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from libs.engine.engine import DecodeSeq, Engine
from libs.engine.sampling import SamplingParams, sample
from libs.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from libs.member.loop import ComputeLoop
from libs.member.timeouts import TIMEOUTS

log = logging.getLogger(__name__)


@dataclass
class Emitted:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "error" once finished


@dataclass(eq=False)
class Sequence:
    pages: list[int]
    prompt_len: int
    first_token: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    eos_ids: frozenset[int]
    send: MemoryObjectSendStream[Emitted]
    receive: MemoryObjectReceiveStream[Emitted]
    generated: int = 0
    last_token: int = 0
    cancelled: bool = False
    finished: bool = False
    released: anyio.Event = field(default_factory=anyio.Event)

    def accept(self, token: int) -> Emitted:
        """Record one sampled token; returns what to emit (and whether it ended)."""
        self.generated += 1
        self.last_token = token
        eos = token in self.eos_ids and not self.params.ignore_eos
        if eos or token in self.params.stop_token_ids:
            return Emitted([token], self.detok.finish(), "stop")
        text = self.detok.push(token)
        if self.detok.stopped:
            return Emitted([token], text, "stop")
        if self.generated >= self.params.max_tokens:
            return Emitted([token], text + self.detok.finish(), "length")
        return Emitted([token], text)


class Batcher(ComputeLoop):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch: int = 64,
                 stall_after: float = TIMEOUTS.decode_stall_seconds):
        super().__init__(stall_after)
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.steps = 0

    def admit(self, pages, prompt_len: int, first_token: int, params: SamplingParams) -> Sequence:
        send, receive = anyio.create_memory_object_stream[Emitted](params.max_tokens + 2)
        seq = Sequence(
            pages=pages,
            prompt_len=prompt_len,
            first_token=first_token,
            params=params,
            detok=IncrementalDetokenizer(self.tokenizer, params.stop),
            eos_ids=frozenset(self.tokenizer.eos_token_ids),
            send=send,
            receive=receive,
        )
        emitted = seq.accept(first_token)  # sampled by the prefill
        send.send_nowait(emitted)
        if emitted.finish_reason is not None:
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
            room = self.max_batch - len(self.running)
            self.running.extend(self.waiting[:room])
            del self.waiting[:room]
            try:
                await self._step()
            except Exception:  # contained: the batch fails, the loop lives on
                log.exception("decode step failed; failing %d sequences", len(self.running))
                for seq in self.running:
                    seq.send.send_nowait(Emitted([], "", "error"))
                    self._finish(seq)
                self.running.clear()

    async def _step(self) -> None:
        batch = [
            DecodeSeq(pages=s.pages, pos=s.prompt_len + s.generated - 1, token=s.last_token)
            for s in self.running
        ]
        self._stepping = True
        try:
            logits = await anyio.to_thread.run_sync(self.engine.decode_step, batch)
        finally:
            self._stepping = False
        self.steps += 1
        self.progressed()
        for seq, row in zip(list(self.running), logits, strict=True):
            if seq.cancelled:
                self.running.remove(seq)
                self._finish(seq)
                continue
            emitted = seq.accept(sample(row, seq.params, seq.generated))
            seq.send.send_nowait(emitted)
            if emitted.finish_reason is not None:
                self.running.remove(seq)
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        seq.send.close()
        seq.released.set()
