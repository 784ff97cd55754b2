"""Score (prefill, decode) pairs by the KV work a request would cost on each, plus load.

Pure: the router's view of the members' prefix caches (kv_view.py) says how many leading
pages of the prompt each member holds; this module turns that into a choice. A prefill
computes every prompt token past the prefix it holds (at least the last token, whose
logits give the first token); the KV of every page past the prefix the decode holds
moves. Load is counted in the same unit, tokens of work: each request a member has in
flight costs ``Weights.load``. Among equal costs the pair whose members were placed least
wins, so conversations that start together spread over the members instead of piling
onto the first by name.

A turn of a conversation is "landed" when its pair holds as much of its prompt as any
prefill and any decode does (``landing``): the router counts it per outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Weights:
    compute: float = 1.0   # per prompt token the prefill must run through the model
    move: float = 1.0      # per prompt token whose KV moves to the decode
    load: float = 32.0     # per request in flight on either member


@dataclass(frozen=True)
class Candidate:
    prefill: str
    decode: str
    prefill_hit: int   # leading prompt pages the prefill holds
    decode_hit: int    # leading prompt pages the decode holds
    load: int          # requests in flight on the prefill plus on the decode
    placed: int = 0    # requests placed on the two members so far
    avoided: int = 0   # members of the pair that a failed attempt just used


def cost(c: Candidate, prompt_tokens: int, page_size: int, w: Weights = Weights()) -> float:
    """Tokens of work the request costs on this pair (lower is better)."""
    cached = min(c.prefill_hit * page_size, max(prompt_tokens - 1, 0))
    held = min(c.decode_hit * page_size, prompt_tokens)
    return (w.compute * (prompt_tokens - cached) + w.move * (prompt_tokens - held)
            + w.load * c.load)


def best(candidates: Sequence[Candidate], prompt_tokens: int, page_size: int,
         w: Weights = Weights()) -> Candidate:
    """The cheapest candidate; avoided members only when nothing else is left, then
    fewest placements, then names (deterministic)."""
    if not candidates:
        raise ValueError("no candidate pairs")
    return min(candidates, key=lambda c: (c.avoided, cost(c, prompt_tokens, page_size, w),
                                          c.placed, c.prefill, c.decode))


def landing(chosen: Candidate, candidates: Sequence[Candidate]) -> str:
    """``cold``: no member holds a page of the prompt; ``landed``: the chosen prefill and
    decode hold as much of it as any do; ``elsewhere``: another member holds more."""
    most_p = max(c.prefill_hit for c in candidates)
    most_d = max(c.decode_hit for c in candidates)
    if most_p == 0 and most_d == 0:
        return "cold"
    return "landed" if (chosen.prefill_hit, chosen.decode_hit) == (most_p, most_d) \
        else "elsewhere"
