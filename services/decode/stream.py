"""A sequence's tokens as its request sends them: detokenized, stop strings applied, and
as few chunks as the reader's pace allows.

The step loop only hands token ids to the sequence's stream; this reader turns them into
text on the event loop while the next step computes, so detokenizing never delays a step.
Each read takes every token sampled since the last one: a reader that keeps up sends one
token a message, one that falls behind (a slow network write, a busy loop) sends several
in one, so the message rate never has to match the token rate.

Falling behind alone is not enough under a large batch: the step loop and 128 readers
share one event loop, and a reader that writes after every step keeps them in lockstep,
one message per token, so the per-message cost (a gRPC write here and a relay in the
router, tens of microseconds each) sets the step rate. So each stream also keeps a pace:
after a message it waits out its share of the decode's message budget (``pace()``, the
batch size over ``--message-rate``) before it takes the next tokens. At one stream the
share is a fraction of a step and every token goes out alone; at 128 it is a few steps,
and each message carries the tokens sampled meanwhile.

A stop string ends the sequence here: the reader takes it out of the batch (its pages are
released the usual way, once the batcher lets go of it) and drops the tokens sampled
after the one that completed the stop string.

A preempted sequence's last chunk flushes the text held back (a partial character, a
possible stop-string prefix): the router re-runs the rest as a new request, whose reader
starts afresh, so a stop string that would span the pause is not matched.
"""

from __future__ import annotations

import time
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
                 stop_sequence: Callable[[Sequence], None],
                 pace: Callable[[], float] = lambda: 0.0):
        """pace: the least time between two messages of this stream, in seconds, asked
        after each message (the batch changes size as requests come and go)."""
        self.seq = seq
        self.pace = pace
        self._next_at = 0.0  # time.monotonic() before which no message goes out
        self.detok = IncrementalDetokenizer(tokenizer, seq.params.stop)
        self.stop_sequence = stop_sequence
        self.completion_tokens = 0  # tokens handed out, the one that ended the stream included

    async def next(self) -> Chunk:
        """Every token sampled since the last call (waiting for at least one).

        Raises anyio.EndOfStream when the sequence was cancelled before it finished.
        """
        queue = self.seq.tokens
        # The pace first: the tokens sampled meanwhile go in this message, and a reader
        # paced over several steps wakes once a message, not once for its first token
        # and again for the rest.
        if (wait := self._next_at - time.monotonic()) > 0:
            await anyio.sleep(wait)
        await queue.wait()
        if queue.ended:
            raise anyio.EndOfStream
        self._next_at = time.monotonic() + self.pace()
        return self._chunk(queue.take())

    def _chunk(self, items: list[Sampled]) -> Chunk:
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        # Without stop strings the chunk's tokens are detokenized together (two decodes,
        # not two a token); with them, one by one, to stop at the token that completes one.
        pending: list[int] = []

        def chunk(finish_reason: str | None = None, last: bool = False) -> Chunk:
            if pending:
                text.append(self.detok.push_many(pending))
            if last:  # the text held back (a partial character, a stop-string prefix)
                text.append(self.detok.finish())
            return Chunk(ids, "".join(text), finish_reason, logprobs)

        for item in items:
            if item.finish_reason == "error":
                return chunk("error")
            if item.finish_reason == "preempted":  # every token so far goes out with it
                return chunk("preempted", last=True)
            ids.append(item.token)
            if item.logprob is not None:
                logprobs.append(item.logprob)
            self.completion_tokens += 1
            if item.finish_reason == "stop":  # EOS or a stop token: no text of its own
                return chunk("stop", last=True)
            if self.detok.stop:
                text.append(self.detok.push(item.token))
                if self.detok.stopped:
                    self.stop_sequence(self.seq)
                    return chunk("stop")
            else:
                pending.append(item.token)
            if item.finish_reason == "length":
                return chunk("length", last=True)
        return chunk()
