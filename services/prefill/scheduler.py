"""Pack the pending prefill chunks of every admitted request into one forward pass.

Requests arrive one by one, but the weights are the cost: sixteen short prompts
prefilled together stream the weights once instead of sixteen times. Each
request submits its next chunk and waits for that chunk's logits; the one
scheduler task takes chunks in arrival order up to a token budget and runs them
on the compute thread with `Engine.prefill_batch`.

A chunk that is already computing always ends before its caller returns, even
when the caller is cancelled: its KV lands in the caller's pages, which must
not be freed (and reused) under a running forward pass. When every caller of
a running pass has left, the pass stops at the next layer boundary (W1). On a
GPU a pass returns only once the device has run it (`settle`), so the NIXL
write its caller posts next reads the chunk's KV, not what the pages held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import torch

from libs.engine.engine import Engine, ForwardCancelled, PrefillSeq
from libs.member.loop import ComputeLoop
from libs.member.timeouts import TIMEOUTS
from libs.transfer.agent import settle

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Chunk:
    seq: PrefillSeq
    started: anyio.Event = field(default_factory=anyio.Event)  # a forward pass took it
    done: anyio.Event = field(default_factory=anyio.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    cancelled: bool = False  # its caller left; read by the compute thread between layers


class PrefillScheduler(ComputeLoop):
    def __init__(self, engine: Engine, max_batch_tokens: int = 512,
                 stall_after: float = TIMEOUTS.prefill_stall_seconds, stall_forward: float = 0.0):
        super().__init__(stall_after)
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.stall_forward = stall_forward  # fault injection: a wedged compute thread
        self.pending: list[Chunk] = []
        self.running: list[Chunk] = []
        self.forwards = 0
        self.stopped_early = 0

    async def prefill(
        self, tokens: list[int], pages: list[int], start: int,
        on_start: Callable[[], Awaitable[None]] | None = None, all_logits: bool = False,
    ) -> torch.Tensor:
        """The logits of the chunk's last token, once its KV is in `pages` (with
        `all_logits`, [len(tokens), vocab]: every token's, for prompt logprobs).

        `on_start` is awaited once a forward pass has taken the chunk, while it computes:
        until then the request is queued, which its trace should say.
        """
        chunk = Chunk(PrefillSeq(tokens, pages, start, all_logits))
        self.pending.append(chunk)
        self.wake()
        try:
            if on_start is not None:
                await chunk.started.wait()
                await on_start()
            await chunk.done.wait()
        except BaseException:
            if chunk in self.pending:  # never started: just withdraw it
                self.pending.remove(chunk)
            else:  # running: ask the pass to stop early (W1), then wait until it has
                chunk.cancelled = True
                with anyio.move_on_after(TIMEOUTS.finish_seconds, shield=True):
                    await chunk.done.wait()
            raise
        if chunk.error is not None:
            raise chunk.error
        return chunk.logits

    async def run(self) -> None:
        """Run forever: the one owner of the prefill compute thread."""
        while True:
            await self.until_busy()
            batch = self.running = self._take()
            for chunk in batch:
                chunk.started.set()
            try:
                logits = await anyio.to_thread.run_sync(
                    self._forward,
                    [c.seq for c in batch],
                    lambda batch=batch: all(c.cancelled for c in batch),
                )
                rows = logits.split(self.engine.logit_rows([c.seq for c in batch]))
                for chunk, chunk_rows in zip(batch, rows, strict=True):
                    chunk.logits = chunk_rows if chunk.seq.all_logits else chunk_rows[0]
            except ForwardCancelled as e:  # every caller of this pass has left
                self.stopped_early += 1
                for chunk in batch:
                    chunk.error = e
            except Exception as e:  # contained: these chunks fail, the loop lives on
                log.exception("prefill forward of %d chunks failed", len(batch))
                for chunk in batch:
                    chunk.error = e
            finally:
                self.forwards += 1
                self.progressed()
                self.running = []
                for chunk in batch:
                    chunk.done.set()

    def _forward(self, seqs: list[PrefillSeq], should_stop) -> torch.Tensor:
        if self.stall_forward:
            time.sleep(self.stall_forward)  # blocks the compute thread, as a wedge would
        logits = self.engine.prefill_batch(seqs, should_stop)
        settle(self.engine.pool.device)
        return logits

    def busy(self) -> bool:
        return bool(self.pending or self.running)

    def _take(self) -> list[Chunk]:
        batch, total = [], 0
        while self.pending:
            n = len(self.pending[0].seq.tokens)
            if batch and total + n > self.max_batch_tokens:
                break
            batch.append(self.pending.pop(0))
            total += n
        return batch

