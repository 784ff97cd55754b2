"""What every side of `pdmesh bench` serves, and how its answers are measured.

A Workload is a list of requests (prompt token ids, new tokens) and an arrival rule:
closed loop (at most ``concurrency`` requests in flight, the next sent when one ends; all
of them at once when concurrency >= the count) or open loop (Poisson arrivals at
``rate`` requests/s, seeded). Each side (the mesh, the engine alone, transformers)
serves it in its own way and hands back one Record per request: when it was sent and
when each piece of its output arrived. `summarize` turns Records into the same figures
for every side:

* TTFT: sent to first token; E2E: sent to last token (p50/p90/p99, mean, max);
* inter-token latency: the gap before each piece of a stream spread over the tokens of
  that piece (a piece of k tokens after a gap g counts k gaps of g/k: what the reader sees
  per token when several tokens travel in one message);
* output tok/s: every new token over the span from the first request sent to the last
  token; decode-phase tok/s: tokens after each stream's first over the span from the first
  first-token to the last token; per-stream decode tok/s: (n - 1) / (last - first).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class Lengths:
    """A token count: fixed (``"128"``) or uniform over a closed range (``"64:256"``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        low, _, high = text.partition(":")
        try:
            a, b = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"{text!r} is not N or A:B (token counts)") from None
        if not 1 <= a <= b:
            raise ValueError(f"{text!r}: need 1 <= A <= B")
        return cls(a, b)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class Request:
    index: int
    prompt_ids: list[int]  # what the engine and transformers are given
    output_tokens: int
    text: str | None = None  # what the mesh is sent: a raw prompt ...
    messages: list[dict[str, str]] | None = None  # ... or chat turns (the router templates)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    concurrency: int  # closed loop: requests in flight at most (unused when rate is set)
    rate: float | None = None  # open loop: Poisson arrivals, requests/s
    seed: int = 0

    def arrivals(self) -> list[float]:
        """Open loop: each request's send time, seconds after the start (the first at 0)."""
        assert self.rate, "closed-loop workloads have no fixed arrival times"
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in self.requests:
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

    def describe(self) -> dict:
        prompts = [len(r.prompt_ids) for r in self.requests]
        outputs = [r.output_tokens for r in self.requests]
        return {
            "requests": len(self.requests),
            "arrivals": f"poisson {self.rate}/s" if self.rate else
            f"closed loop, concurrency {self.concurrency}",
            "prompt_tokens": {"min": min(prompts), "max": max(prompts),
                              "mean": sum(prompts) / len(prompts)},
            "output_tokens": {"min": min(outputs), "max": max(outputs),
                              "mean": sum(outputs) / len(outputs)},
            "seed": self.seed,
        }


@dataclass
class Record:
    """One request as a side served it; times in seconds from the workload's start."""

    sent: float
    pieces: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.pieces)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear between ranks) and max; None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)

    def at(q: float) -> float:
        x = q * (len(v) - 1)
        i = int(x)
        return v[i] if i + 1 >= len(v) else v[i] + (v[i + 1] - v[i]) * (x - i)

    return {"mean": sum(v) / len(v), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "max": v[-1]}


def summarize(records: list[Record], expected: list[int] | None = None) -> dict:
    """The figures of one run of a workload. ``expected``: each request's new tokens; a
    request that streamed another count is an error ("short")."""
    if expected is not None:
        for r, n in zip(records, expected, strict=True):
            if r.error is None and r.tokens != n:
                r.error = f"short: {r.tokens} of {n} tokens"
    ok = [r for r in records if r.error is None and r.pieces]
    ttft = [r.pieces[0][0] - r.sent for r in ok]
    e2e = [r.pieces[-1][0] - r.sent for r in ok]
    itl: list[float] = []
    streams: list[float] = []
    for r in ok:
        for (t0, _), (t1, k) in pairwise(r.pieces):
            itl += [(t1 - t0) / k] * k
        after_first = r.tokens - r.pieces[0][1]
        if after_first and r.pieces[-1][0] > r.pieces[0][0]:
            streams.append(after_first / (r.pieces[-1][0] - r.pieces[0][0]))
    tokens = sum(r.tokens for r in ok)
    out: dict = {
        "requests": len(records), "completed": len(ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "output_tokens": tokens, "duration_s": None, "output_tok_s": None,
        "decode_tok_s": None,
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
        "stream_decode_tok_s": percentiles(streams),
    }
    if ok:
        start = min(r.sent for r in records)
        last = max(r.pieces[-1][0] for r in ok)
        first = min(r.pieces[0][0] for r in ok)
        out["duration_s"] = last - start
        out["output_tok_s"] = tokens / (last - start) if last > start else None
        after = sum(r.tokens - r.pieces[0][1] for r in ok)
        out["decode_tok_s"] = after / (last - first) if last > first else None
    return out


def agreement(ours: list[Record], theirs: list[Record]) -> dict:
    """How many requests got the same token ids on two sides (greedy: they should)."""
    pairs = [(a.token_ids, b.token_ids) for a, b in zip(ours, theirs, strict=True)
             if a.error is None and b.error is None]
    return {"compared": len(pairs), "equal": sum(a == b for a, b in pairs)}
