"""Sampling whose randomness is a pure function of (seed, step).

Prefill samples token 0 in one process and decode samples tokens 1.. in another; seeding a fresh
generator from (seed, step) makes the stream identical to a colocated run, whoever samples.
Sampling happens on CPU in float64 so that CPU and GPU engines agree given equal logits.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a random one drawn once per request."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit generator seed for token `step` of a request seeded `seed`."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 1


def sample(
    logits: torch.Tensor, params: SamplingParams, step: int, seed: int | None = None
) -> int:
    """Token for one position. logits: [vocab]. ``seed`` is used when params.seed is None."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    s = params.seed if params.seed is not None else seed
    if s is None:
        s = secrets.randbits(63)
    probs = torch.softmax(logits.detach().to("cpu", torch.float64) / params.temperature, -1)
    probs, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(probs, 0)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=cum.dtype))) + 1
        cum = cum[: min(keep, cum.numel())]
    gen = torch.Generator().manual_seed(step_seed(s, step))
    u = torch.rand((), generator=gen, dtype=torch.float64) * cum[-1]
    idx = min(int(torch.searchsorted(cum, u.reshape(1), right=True)), cum.numel() - 1)
    return int(order[idx])

