"""CUDA graphs of the prefill forward, one per (tokens, keys, rows) bucket.

Why: an eager prefill of a small model launches a few hundred kernels whatever the
prompt's length, and launching them costs the host far more than the GPU spends on a
few hundred tokens, so the time to first token would be the host's. A graph replays
them in one call.

A pack's shapes are its token count T, its key count K (each chunk attends to its whole
sequence so far) and its output rows R. The buckets: T_b the powers of two from
``MIN_TOKENS`` up to the pack budget; for each, K_b = T_b, 4 T_b, 16 T_b ... up to the
longest context (a bucket of 4x more keys costs little: attention over a few thousand
keys is a sliver of a prefill pass); R_b = min(T_b, ``MAX_ROWS``). A pack padded to the
smallest bucket that holds it (prefill_pack.py says how padding stays harmless) is one
host-to-device copy of its int32 array into a static buffer and one replay. A pack that
fits no bucket (more rows than ``MAX_ROWS``: prompt logprobs or many tiny chunks; more
keys than the longest context) runs eagerly, with the same result.

The graphs are captured at start, before any page holds KV: the warm-up and capture
passes run an all-padding pack, which writes its K/V into page 0. All graphs share one
memory pool, captured largest first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .graphs import WARMUP_RUNS, GraphOutOfMemory, _on, _out_of_memory
from .prefill_pack import PackedPrefill, packed_size

MIN_TOKENS = 16
KEY_GROWTH = 4
MAX_ROWS = 32

Bucket = tuple[int, int, int]  # (tokens, keys, rows)


def prefill_buckets(max_tokens: int, max_keys: int) -> list[Bucket]:
    """Every (T_b, K_b, R_b), smallest first."""
    if max_tokens < 1 or max_keys < max_tokens:
        raise ValueError(f"need 1 <= max_tokens <= max_keys, got {max_tokens}, {max_keys}")
    tokens, t = [], MIN_TOKENS
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    tokens.append(max_tokens if tokens else MIN_TOKENS)  # the budget itself, at least 16
    out = []
    for t in tokens:
        k = t
        while True:
            out.append((t, min(k, max_keys), min(t, MAX_ROWS)))
            if k >= max_keys:
                break
            k *= KEY_GROWTH
    return out


class PrefillGraphs:
    """``run(packed)`` replays the graph of ``packed``'s bucket: logits [R_b, V], a view
    of the graph's output buffer, valid until the next run. forward maps (int32 data on
    the device, T, K, R) to logits [R, V] (Engine.prefill_packed)."""

    def __init__(self, forward: Callable[[torch.Tensor, int, int, int], torch.Tensor],
                 device: torch.device | str, max_tokens: int, max_keys: int) -> None:
        self.forward = forward
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError("prefill graphs need a CUDA device")
        self.buckets = prefill_buckets(max_tokens, max_keys)
        size = max(packed_size(*b) for b in self.buckets)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.static = self.host.to(self.device)
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        with _on(self.device):
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
            self._copied = torch.cuda.Event()  # the host buffer is free once it is past

    def bucket(self, tokens: int, keys: int, rows: int) -> Bucket | None:
        """The smallest captured bucket holding the pack, or None (run it eagerly)."""
        return next((b for b in self.buckets if b in self.graphs and b[0] >= tokens
                     and b[1] >= keys and b[2] >= rows), None)

    def run(self, packed: PackedPrefill) -> torch.Tensor:
        graph, out = self.graphs[(packed.tokens, packed.keys, packed.rows)]
        n = packed.data.size
        with _on(self.device):
            self._copied.synchronize()
            self.host[:n].copy_(torch.from_numpy(packed.data))
            self.static[:n].copy_(self.host[:n], non_blocking=True)
            self._copied.record()
            graph.replay()
        return out

    def capture_all(self) -> list[Bucket]:
        """Capture every bucket, largest first; returns them, smallest first."""
        for b in sorted(self.buckets, key=lambda b: packed_size(*b), reverse=True):
            if b not in self.graphs:
                self.capture(b)
        return list(self.buckets)

    def capture(self, bucket: Bucket) -> None:
        """Warm the bucket up eagerly on the capture stream, then capture it, over an
        all-padding pack (every id 0: one token at position 0 of page 0, attending to
        itself)."""
        t, k, r = bucket
        try:
            with _on(self.device):
                data = self.static[: packed_size(*bucket)]
                data.zero_()
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP_RUNS):
                        self.forward(data, t, k, r)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                      capture_error_mode="thread_local"):
                    out = self.forward(data, t, k, r)
        except Exception as e:
            if _out_of_memory(e):
                raise GraphOutOfMemory(bucket, (
                    f"CUDA out of memory capturing the prefill graph for {t} tokens and "
                    f"{k} keys: lower --max-batch-tokens (the largest pack), shrink the KV "
                    "pool (--kv-pages), or prefill without graphs (--cuda-graphs off)"
                )) from e
            raise
        self.graphs[bucket] = (graph, out)
