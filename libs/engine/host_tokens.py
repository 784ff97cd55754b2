"""A step's sampled token ids on their way to the host, without waiting for them.

`tokens.tolist()` on a CUDA tensor blocks the calling thread until the device has run
everything queued before it. A decode loop that overlaps steps must not block when it
launches a step, only later when it takes that step's tokens: `start` queues the copy
into pinned host memory and records an event behind it; `Pending.wait` blocks on that
event alone.

Two pinned buffers take turns, so a copy may be queued while the previous one is still
pending: enough for a loop that keeps at most one step on the device ahead of the one
it hands off (services/decode/batcher.py). A third outstanding copy is refused. On the
CPU there is nothing to wait for: the ids are read at once.
"""

from __future__ import annotations

import torch


class Pending:
    """One step's token ids, read on the host by ``wait``."""

    def __init__(self, ids: list[int] | None = None, host: torch.Tensor | None = None,
                 event: torch.cuda.Event | None = None) -> None:
        self._ids = ids
        self._host = host
        self._event = event

    def wait(self) -> list[int]:
        """The ids, once the device has copied them (blocks the calling thread)."""
        if self._ids is None:
            self._event.synchronize()
            self._ids = self._host.tolist()
            self._host = self._event = None  # the buffer is the next copy's again
        return self._ids

    @property
    def done(self) -> bool:
        return self._ids is not None


class HostTokens:
    """Queues token-id copies to the host, two buffers taking turns (see the module)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._pending: list[Pending | None] = [None, None]
        self._turn = 0

    def start(self, tokens: torch.Tensor) -> Pending:
        """Queue the copy of ``tokens`` [B] (int64) to the host on the current stream of
        their device (which need not be the thread's current device)."""
        if tokens.device.type != "cuda":
            return Pending(ids=tokens.tolist())
        turn, n = self._turn, tokens.numel()
        earlier = self._pending[turn]
        if earlier is not None and not earlier.done:
            raise RuntimeError("two token copies are already pending: wait for one first")
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < n:  # sized for the largest batch seen
            buffer = self._buffers[turn] = torch.empty(max(n, 256), dtype=torch.int64,
                                                       pin_memory=True)
        host = buffer[:n]
        host.copy_(tokens, non_blocking=True)
        event = self._events[turn]
        if event is None:
            event = self._events[turn] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))
        pending = self._pending[turn] = Pending(host=host, event=event)
        self._turn = 1 - turn
        return pending
