"""Whether a model's weights fit the device, decided from its shape before any is allocated.

Why: a model too large for the device would otherwise fail deep inside the load, as a CUDA
out-of-memory traceback or the kernel's OOM killer on the CPU (the process vanishes,
nothing said), after minutes of work. The shape is known before the weights (specs.py),
so the load is refused first, with the bytes it needs and the bytes there are.

The bytes counted are what the loaded weights hold on the device: embedding, lm_head
(once when tied), norms and the layer linears, dense in the serving dtype or NVFP4 (a
packed byte per two weights, an e4m3 scale per 16; on the CPU also the dense copy the
engine computes with, see nvfp4.py). Available is what the device has free now: CUDA's
free memory (every process's use subtracted), or the kernel's MemAvailable on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig

GIB = 1 << 30


class ModelTooLarge(ValueError):
    """The model's weights need more memory than the device has available."""


def linear_weights(config: ModelConfig) -> int:
    """Weights of one layer's four linears (wqkv, wo, w_gate_up, w_down)."""
    c = config
    return (c.q_dim + 2 * c.kv_dim) * c.dim + c.dim * c.q_dim + 3 * c.ffn_dim * c.dim


def nvfp4_bytes(n_weights: int) -> int:
    """Packed codes (half a byte a weight) plus e4m3 block scales (one byte per 16)."""
    return n_weights // 2 + n_weights // 16


def weight_bytes(config: ModelConfig, dtype: torch.dtype, weights_format: str,
                 device_type: str) -> int:
    """Bytes the loaded weights hold on a device of `device_type` ("cpu", "cuda")."""
    c, e = config, torch.empty((), dtype=dtype).element_size()
    dense = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + (2 * c.n_layers + 1) * c.dim
    linears = c.n_layers * linear_weights(c)
    if weights_format == "native":
        return (dense + linears) * e
    per_layer_scales = 4 * 4 * c.n_layers  # an fp32 s2 per linear
    total = dense * e + nvfp4_bytes(linears) + per_layer_scales
    if device_type == "cpu":
        total += linears * e  # the dense copy the CPU computes with
    return total


def available_bytes(device: torch.device) -> int:
    """Free memory on `device`: CUDA's free bytes, or MemAvailable on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(spec: str, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               weights_format: str, available: int | None = None) -> int:
    """The weights' bytes; raises ModelTooLarge (bytes needed and available, and what to
    change) when they exceed what `device` has available (`available` overrides the
    reading, for tests)."""
    need = weight_bytes(config, dtype, weights_format, device.type)
    have = available_bytes(device) if available is None else available
    if need > have:
        dtype_name = str(dtype).removeprefix("torch.")
        hint = "" if weights_format == "nvfp4" else ", --weights nvfp4"
        raise ModelTooLarge(
            f"{spec} does not fit {device}: its {weights_format} {dtype_name} weights need "
            f"{need:,} bytes ({need / GIB:.2f} GiB) and {have:,} bytes "
            f"({have / GIB:.2f} GiB) are available. Use a larger device, a smaller model"
            f"{hint} or a smaller --dtype"
        )
    return need
