"""Sampling for a whole batch on the logits' device, with randomness that is a pure function
of (seed, step).

One call samples every row of a ``[B, vocab]`` batch (greedy, temperature, top-k, top-p, each
row with its own parameters) and returns ``[B]`` token ids as one device tensor, so a decode
step pays one device-to-host copy for the whole batch.

The draw is Gumbel-max: the token is ``argmax(logits / temperature + g)`` over the tokens the
filters keep, where ``g[v] = -log(-log(u[v]))`` and ``u[v]`` is the ``v``-th output of a
SplitMix64 generator seeded by ``step_seed(seed, step)``. Every uniform is integer arithmetic
on a counter (no generator state, no device RNG), so a request's token at step n depends only
on its logits, its parameters, its seed and n: not on which requests share the batch, on the
process that samples (the prefill samples token 0, the decode the rest), nor on the device.
Scores are float64 so that CPU and CUDA agree except at ties within float64 rounding.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # The step of the first token: a preempted request's re-run starts where its stream
    # paused, so its seeded draws are the ones an unpreempted run makes.
    start_step: int = 0
    logprobs: bool = False  # report each sampled token's log-probability (logprobs.py)
    top_logprobs: int = 0  # and this many most likely alternatives
    prompt_logprobs: bool = False  # the prefill reports every prompt token's too (echo)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a random one drawn once per request."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit key for token `step` of a request seeded `seed`."""
    return _splitmix64(_seed_state(seed) ^ step) >> 1


@functools.lru_cache(maxsize=4096)
def _seed_state(seed: int) -> int:
    """The seed's half of step_seed, computed once per request rather than every step."""
    return _splitmix64(seed & _MASK64)


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no full uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 bits.

    int64 products wrap modulo 2**64 on CPU and CUDA alike, which is the uint64 arithmetic
    SplitMix64 is defined in.
    """
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def step_keys(seed_states: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``step_seed`` for a batch, on the tensors' device: [B] int64 from each row's
    ``_seed_state(seed)`` (as int64 bits) and step."""
    return _shr(_mix((seed_states ^ steps) + _signed(_GOLDEN)), 1)


def token_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u[b, v]`` in (0, 1), float64: output ``v`` of SplitMix64 seeded by ``keys[b]``.

    The top 53 bits of each output become the uniform, centred in its interval so that
    neither 0 nor 1 occurs.
    """
    offsets = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _signed(_GOLDEN)
    z = _mix(keys[:, None] + offsets)
    return (_shr(z, 11).to(torch.float64) + 0.5) * 2.0**-53


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float64; 0 = greedy
    top_p: torch.Tensor  # [B] float64
    top_k: torch.Tensor  # [B] int64; 0 = no top-k
    key: torch.Tensor  # [B] int64: step_seed(seed, step) of the row's request and step
    filtered: bool  # some row has top-k or top-p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        device: torch.device | str,
    ) -> BatchSampling | None:
        """The rows' parameters in one host-to-device copy: a [5, B] int64 tensor whose
        float rows carry float64 bits; the step keys are mixed on the device. None when
        every row is greedy: there is nothing to draw, and nothing to copy."""
        if all(p.temperature == 0 for p in params):
            return None
        floats = torch.tensor(
            [[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float64
        )
        ints = torch.tensor(
            [[p.top_k for p in params], [_signed(_seed_state(s)) for s in seeds], list(steps)],
            dtype=torch.int64,
        )
        packed = torch.cat([floats.view(torch.int64), ints])
        if torch.device(device).type == "cuda":  # from pinned memory: the copy waits for
            packed = packed.pin_memory().to(device, non_blocking=True)  # nothing queued
        else:
            packed = packed.to(device)
        return cls(
            temperature=packed[0].view(torch.float64),
            top_p=packed[1].view(torch.float64),
            top_k=packed[2],
            key=step_keys(packed[3], packed[4]),
            filtered=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
        )


def _kept(logits: torch.Tensor, s: BatchSampling) -> torch.Tensor:
    """[B, V] bool: the tokens top-k then top-p keep, row by row.

    Top-k keeps the k largest logits; top-p then keeps the smallest prefix (by probability)
    of those whose mass reaches top_p. A row keeps every token tied with its last kept one.
    """
    vocab = logits.shape[-1]
    order = torch.sort(logits, dim=-1, descending=True).values
    k = torch.where(s.top_k > 0, s.top_k.clamp(max=vocab), vocab)
    rank = torch.arange(vocab, device=logits.device)
    in_k = rank[None, :] < k[:, None]
    # top-p weighs the tokens by the distribution they are drawn from: after temperature
    sorted_scaled = order.to(torch.float64) / _safe(s.temperature)[:, None]
    probs = torch.softmax(sorted_scaled.masked_fill(~in_k, float("-inf")), dim=-1)
    reached = (probs.cumsum(-1) < s.top_p[:, None]).sum(-1) + 1
    n = torch.minimum(torch.where(s.top_p >= 1, vocab, reached), k)
    threshold = order.gather(-1, (n - 1)[:, None])
    return logits >= threshold


def _safe(temperature: torch.Tensor) -> torch.Tensor:
    """Temperatures to divide by: greedy rows (0) divide by 1 and are replaced by argmax."""
    return torch.where(temperature > 0, temperature, 1.0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [B, V]: on CUDA through libs/kernels/argmax.py (the same
    indices; torch's reduces a row in one block, ~27 us for a 128k vocabulary)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        from libs.kernels.argmax import argmax  # Triton: only where the GPU runs

        return argmax(logits)
    return logits.argmax(-1)


def sample_batch(logits: torch.Tensor, sampling: BatchSampling | None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: ``[B]`` int64 on the logits' device.

    Greedy rows (temperature 0; every row when ``sampling`` is None) are exactly
    ``argmax``. The rest draw by Gumbel-max over the tokens their filters keep, with
    uniforms from their own (seed, step) only.
    """
    greedy = greedy_tokens(logits)
    if sampling is None:
        return greedy
    gumbel = token_uniforms(sampling.key, logits.shape[-1]).log_().neg_().log_().neg_()
    scores = gumbel.add_(logits.to(torch.float64) / _safe(sampling.temperature)[:, None])
    if sampling.filtered:
        scores = scores.masked_fill_(~_kept(logits, sampling), float("-inf"))
    return torch.where(sampling.temperature > 0, scores.argmax(-1), greedy)


def sample(
    logits: torch.Tensor, params: SamplingParams, step: int, seed: int | None = None
) -> int:
    """Token for one position. logits: [vocab]. ``seed`` is used when params.seed is None.

    The same draw as that row inside any batch: ``sample_batch`` on a batch of one.
    """
    s = params.seed if params.seed is not None else seed
    if s is None:
        s = secrets.randbits(63)
    sampling = BatchSampling.build([params], [s], [step], logits.device)
    return int(sample_batch(logits[None], sampling)[0])
