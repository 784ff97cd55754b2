"""Zeroed int32 counters for kernels whose split programs elect the last to arrive.

A kernel split across programs (split-K in the NVFP4 linears, split keys in decode
attention) can finish in the same launch: each program publishes its partial, bumps its
tile's counter, and the one that brings it to the split count sums every partial and
resets the counter to zero. Every launch leaves the counters it used at zero, so one
buffer serves every such kernel on a stream without a memset (launches on one stream run
one after another), and inside a CUDA graph its address stays fixed. Keyed by stream,
because two launches running at once must not share counters.
"""

from __future__ import annotations

import torch

_counters: dict[tuple, torch.Tensor] = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters of (device, its current stream)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf
