"""CUDA graphs of the decode forward, one per batch-size bucket.

Why: an eager decode step of a small model is hundreds of kernel launches, and the host's
time to launch them, not the GPU, sets its speed. A graph replays them all in one call.

A graph reads and writes fixed addresses, so everything a step varies lives in one static
int32 buffer [largest bucket, width] on the device, rows of (token, position, length, page
table) in the engine's packed layout (engine.py), sized at start for the longest context;
the pool and the weights are fixed already; the logits are the graph's own output buffer.
A step:

1. waits until the previous step's input copy has left the pinned host buffer (an event,
   normally long past: this is the only wait, and it never waits for the forward);
2. writes its rows into the pinned host buffer, and zeroes the bucket's rows past the
   batch: a zero row is padding, whose length 0 writes no KV;
3. copies the bucket's rows to the device: the step's one host-to-device copy;
   tokens that stand for ids still on the device (the previous step's, sampled but not
   yet read by the host: engine.feed_tokens) are substituted there, after the copy;
4. replays the bucket's graph and returns the first B rows of its logits, on the device.

Buckets are the powers of two below ``max_batch``, and ``max_batch``. A larger batch runs
as several replays. A bucket is captured at its first use, or all of them at start-up by
`capture_all`. Before capture each bucket runs once eagerly on the capture stream with
every row padding (so nothing is written to the pool): Triton compiles its kernels there
and the NVFP4 linears plan their launches (their first call per stream checks the weight,
a host sync that capture forbids). All graphs share one memory pool.

Uncaptured (``capture=False``, and always without CUDA) the same object runs the forward
on the same padded rows, launched eagerly: the static-shape forward a graph replays. The
engine's eager path on CUDA is this, so turning graphs off changes no bit of the logits
(a batch padded to another size, or attention split another way, would: cuBLAS and the
split attention reduce in an order that depends on the shapes), and CPU tests compare it
with the CPU's own eager step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

WARMUP_RUNS = 2  # eager runs of a bucket before its capture


class GraphOutOfMemory(RuntimeError):
    """CUDA ran out of memory capturing a graph (the message names the flags)."""

    def __init__(self, bucket: object, message: str | None = None) -> None:
        super().__init__(message or (
            f"CUDA out of memory capturing the decode graph for a batch of {bucket}: lower "
            "--max-batch (the largest graph bucket), shrink the KV pool (--kv-pages), or "
            "decode without graphs (--cuda-graphs off)"
        ))
        self.bucket = bucket


def buckets_for(max_batch: int) -> list[int]:
    """The powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class DecodeGraphs:
    """``run(packed)`` = ``forward(packed padded to its bucket)[:B]``, replayed from a graph
    on CUDA. forward maps int32 rows [bucket, width] on the device to logits [bucket, V]
    and must treat a zero row as padding."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str, width: int, max_batch: int,
                 capture: bool = True,
                 feed: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """feed(rows, fed): substitutes fed token ids into rows on the device (``run``)."""
        self.forward = forward
        self._feed = feed
        self.device = torch.device(device)
        self.buckets = buckets_for(max_batch)
        self.max_batch = max_batch
        self.width = width
        self.captures = capture and self.device.type == "cuda"
        self.host = torch.zeros((max_batch, width), dtype=torch.int32, pin_memory=self.captures)
        self.static = self.host.to(self.device) if self.captures else self.host
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.captures:
            with _on(self.device):
                self._stream = torch.cuda.Stream(self.device)
                self._pool = torch.cuda.graph_pool_handle()
                self._copied = torch.cuda.Event()  # the host buffer is free once it is past

    def bucket(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows (batch <= max_batch)."""
        return next(b for b in self.buckets if b >= batch)

    def run(self, packed: torch.Tensor, fed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] on the device of packed rows [B, <= width] (int32, on the host).
        Captured, they are a view of the graph's output: valid until the next run.
        ``fed``: device token ids that tokens -(j + 1) stand for (engine.feed_tokens),
        substituted on the device after the copy, before the replay."""
        batch, cols = packed.shape
        if cols > self.width:
            raise ValueError(f"rows of {cols} columns exceed the graphs' {self.width}")
        if batch > self.max_batch:  # several replays; each part copied before the next
            step = self.max_batch
            return torch.cat([self.run(packed[i : i + step], fed).clone()
                              for i in range(0, batch, step)])
        bucket = self.bucket(batch)
        if not self.captures:
            rows = self._fill(packed, bucket).to(self.device)
            self._feed_into(rows, fed)
            return self.forward(rows)[:batch]
        if bucket not in self.graphs:
            self.capture(bucket)
        with _on(self.device):
            self._copied.synchronize()
            rows = self._fill(packed, bucket)
            self.static[:bucket].copy_(rows, non_blocking=True)
            self._copied.record()
            self._feed_into(self.static[:batch], fed)
            graph, out = self.graphs[bucket]
            graph.replay()
        return out[:batch]

    def _feed_into(self, rows: torch.Tensor, fed: torch.Tensor | None) -> None:
        if fed is not None:
            if self._feed is None:
                raise ValueError("these graphs were built without a feed")
            self._feed(rows, fed)

    def _fill(self, packed: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bucket's host rows: the batch's, then padding. Columns past a row's pages
        keep earlier steps' page ids: nothing reads them, and they are valid ids."""
        rows = self.host[:bucket]
        rows[: packed.shape[0], : packed.shape[1]] = packed
        rows[packed.shape[0] :] = 0
        return rows

    def capture_all(self, max_batch: int | None = None) -> list[int]:
        """Capture every bucket up to the one holding max_batch (default all), largest
        first; returns the buckets captured."""
        top = self.bucket(min(max_batch or self.max_batch, self.max_batch))
        todo = [b for b in reversed(self.buckets) if b <= top]
        for b in todo:
            if b not in self.graphs and self.captures:
                self.capture(b)
        return sorted(todo)

    def capture(self, bucket: int) -> None:
        """Warm the bucket up eagerly on the capture stream, then capture it."""
        try:
            with _on(self.device):
                rows = self.static[:bucket]
                rows.zero_()  # every row padding: the warm-up writes no KV
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self.forward(rows)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads (KV transfers, the event loop) may use CUDA
                with torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                      capture_error_mode="thread_local"):
                    out = self.forward(rows)
        except Exception as e:
            if _out_of_memory(e):
                raise GraphOutOfMemory(bucket) from e
            raise
        self.graphs[bucket] = (graph, out)


def _out_of_memory(e: BaseException | None) -> bool:
    """An OOM, or an error raised while a capture that ran out of memory was unwound."""
    while e is not None:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current: a member on cuda:N runs its steps in worker threads whose
    current device is 0, and graphs, streams and Triton launch on the current one."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(device)
    return contextlib.nullcontext()
