"""A sequence's tokens as its request sends them: detokenized, stop strings applied, and
as few chunks as the reader's pace allows.

The step loop only hands token ids to the sequence's stream; this reader turns them into
text on the event loop while the next step computes, so detokenizing never delays a step.
Each read takes every token sampled since the last one: a reader that keeps up sends one
token a message, one that falls behind (a slow network write, a busy loop) sends several
in one, so the message rate never has to match the token rate.

A stop string ends the sequence here: the reader takes it out of the batch (its pages are
released the usual way, once the batcher lets go of it) and drops the tokens sampled
after the one that completed the stop string.

A preempted sequence's last chunk flushes the text held back (a partial character, a
possible stop-string prefix): the router re-runs the rest as a new request, whose reader
starts afresh, so a stop string that would span the pause is not matched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from libs.engine.logprobs import TokenLogprob
from libs.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from services.decode.batcher import Sampled, Sequence


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "error" | "preempted" on the last
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the ids that have one


class TokenStream:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer,
                 stop_sequence: Callable[[Sequence], None]):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer, seq.params.stop)
        self.stop_sequence = stop_sequence
        self.completion_tokens = 0  # tokens handed out, the one that ended the stream included

    async def next(self) -> Chunk:
        """Every token sampled since the last call (waiting for at least one).

        Raises anyio.EndOfStream when the sequence was cancelled before it finished.
        """
        items = [await self.seq.receive.receive()]
        while True:
            try:
                items.append(self.seq.receive.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        return self._chunk(items)

    def _chunk(self, items: list[Sampled]) -> Chunk:
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []

        def chunk(finish_reason: str | None = None) -> Chunk:
            return Chunk(ids, "".join(text), finish_reason, logprobs)

        for item in items:
            if item.finish_reason == "error":
                return chunk("error")
            if item.finish_reason == "preempted":  # every token so far goes out with it
                text.append(self.detok.finish())
                return chunk("preempted")
            ids.append(item.token)
            if item.logprob is not None:
                logprobs.append(item.logprob)
            self.completion_tokens += 1
            if item.finish_reason == "stop":  # EOS or a stop token: no text of its own
                text.append(self.detok.finish())
                return chunk("stop")
            text.append(self.detok.push(item.token))
            if self.detok.stopped:
                self.stop_sequence(self.seq)
                return chunk("stop")
            if item.finish_reason == "length":
                text.append(self.detok.finish())
                return chunk("length")
        return chunk()
