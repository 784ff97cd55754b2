"""KV pages reserved as sequences use them, and preemption when the pool runs dry.

A decode does not reserve pages for prompt + max_tokens up front: a client that asks for
4,096 tokens and stops at 40 would hold 256 pages for 3 of them, and the pool's
concurrency would be bounded by what clients might ask for, not by what they use.
Admission reserves the prompt's pages plus a small growth margin (`reservation`); between
two decode steps every running sequence whose next position lies past its pages gets the
pages it needs (`grow`), oldest first. When the pool has none left, the newest sequence
is preempted: its pages go back to the pool at once and its stream ends with a typed
`Preempted`, after which the router re-runs it (prompt + the tokens already streamed) on
a pair with room.

Giving a preempted sequence's pages back at once follows the abort rule of
docs/design.md: a page is reused only after a fence. A sequence reaches the batch only
after its room's KvReady (every write landed, the fence), and `grow` runs only with no
step on the device (an overlapping batch hands its step off first), so neither a write
nor a step can still touch its pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the CLI imports this module for its flags, before torch is needed
    from libs.engine.kvpool import KvPool

RESERVE_MODES = ("grow", "upfront")
DEFAULT_GROWTH_TOKENS = 16


class Growing(Protocol):
    """What growth needs of a sequence. ``pages`` is the sequence's own list, shared with
    its owner: grow appends to it and a preemption empties it, so the owner's release
    frees exactly what is left."""

    pages: list[int]
    prompt_len: int
    generated: int
    ahead: int  # tokens sampled by a step still on the device
    order: int  # admission order: a larger one is newer


@dataclass(frozen=True)
class Reservation:
    """How many pages a request gets when it is admitted."""

    mode: str = "grow"  # grow | upfront
    growth_tokens: int = DEFAULT_GROWTH_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in RESERVE_MODES:
            raise ValueError(f"reservation mode must be one of {RESERVE_MODES}")
        if self.growth_tokens < 1:
            raise ValueError("growth_tokens must be >= 1")

    def admit_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """Tokens of KV to reserve at admission: prompt + max_tokens up front, or the
        prompt plus the growth margin (never more than the request can use)."""
        if self.mode == "upfront":
            return prompt_tokens + max_tokens
        return prompt_tokens + min(max_tokens, self.growth_tokens)


def pages_short(pool: KvPool, seq: Growing) -> int:
    """Pages the sequence lacks for its next step, which writes the KV of position
    prompt_len + generated + ahead - 1 (the token it feeds)."""
    return max(0, pool.pages_for(seq.prompt_len + seq.generated + seq.ahead) - len(seq.pages))


def grow_if_it_fits(pool: KvPool, seqs: Iterable[Growing]) -> bool:
    """Give every sequence the pages its next step writes if the pool holds them all;
    False, with nothing allocated, if it does not."""
    short = [(seq, n) for seq in seqs if (n := pages_short(pool, seq))]
    if sum(n for _, n in short) > pool.free_count:
        return False
    for seq, n in short:
        seq.pages.extend(pool.alloc(n))
    return True


def grow(pool: KvPool, running: Sequence[Growing], others: Iterable[Growing] = ()
         ) -> list[Growing]:
    """Give every running sequence, oldest first, the pages its next step writes.

    When the pool is short, preempt the newest sequence among ``running`` and ``others``
    (sequences admitted to the batch that do not step yet), which may be the one that
    grows: its pages are freed and its list emptied. Returns the preempted sequences in
    the order they were preempted (newest first); the caller takes them out of the batch
    and ends their streams.
    """
    if grow_if_it_fits(pool, running):  # the common case, and no sorting
        return []
    candidates = sorted([*running, *others], key=lambda s: s.order)  # oldest first
    preempted: list[Growing] = []
    for seq in sorted(running, key=lambda s: s.order):
        while (short := pages_short(pool, seq)) and seq not in preempted:
            if pool.free_count >= short:
                seq.pages.extend(pool.alloc(short))
                break
            victim = candidates.pop()
            pool.free(victim.pages)
            victim.pages.clear()
            preempted.append(victim)
    return preempted
