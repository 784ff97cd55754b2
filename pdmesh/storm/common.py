"""What every storm mode shares: the timeline sampler, quiescence, outcome counting.

The timeline is the operators' view from the field report (inflight, KV pages,
transfer_failed, aborts, pinned rooms, sampled every few seconds) at a finer grain:
a wedge shows as inflight that never drains after the load stops.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import anyio
import grpc

from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.status import collect

KV_ROLES = ("prefill", "decode")
WORDS = "river engine harbour lantern meadow copper signal orchard thunder violet".split()
SAMPLE_PERIOD = 0.1  # seconds between status samples
PRINT_EVERY = 1.0  # seconds between printed timeline lines


def kv_members(status: dict) -> list[dict]:
    return [m for m in status["members"] if m["role"] in KV_ROLES]


def is_quiet(status: dict) -> bool:
    """Every prefill and decode answers inflight 0 and 0 KV pages used (a member that does
    not answer counts as quiet: it holds nothing a later request could wait on)."""
    return all(not m["inflight"] and not m["kv_pages_used"] for m in kv_members(status))


def aborts_by_reason(status: dict, role: str | None = None) -> dict[str, int]:
    total: Counter[str] = Counter()
    for m in kv_members(status):
        if role is None or m["role"] == role:
            total.update(m.get("aborts_by_reason") or {})
    return dict(sorted(total.items()))


def transfer_failed(status: dict, role: str | None = None) -> int:
    return sum(m["transfer_failed_total"] or 0 for m in kv_members(status)
               if role is None or m["role"] == role)


def row(status: dict, t: float, lives: dict | None = None) -> dict:
    """One timeline sample: sums over every prefill and decode. With `lives` (kept by the
    caller across samples), transfer_failed and aborts also count the lives of members
    that were since restarted: a restart resets a member's counters, not the history."""
    kv = kv_members(status)
    lives = {} if lives is None else lives
    for m in kv:
        if m["transfer_failed_total"] is not None:
            lives[(m["name"], m["epoch"])] = (m["transfer_failed_total"],
                                              m.get("aborts_by_reason") or {})
    reasons: Counter[str] = Counter()
    for _, by_reason in lives.values():
        reasons.update(by_reason)
    return {
        "t": round(t, 3),
        "inflight": sum(m["inflight"] or 0 for m in kv),
        "kv_pages_used": sum(m["kv_pages_used"] or 0 for m in kv),
        "transfer_failed": sum(failed for failed, _ in lives.values()),
        "aborts": sum(reasons.values()),
        "aborts_by_reason": dict(sorted(reasons.items())),
        "pinned": sum(len(m["pinned"]) for m in kv),
        # the evidence, when there is some: who holds the room, in which state, how long
        **({"pinned_rooms": [{"member": m["name"], **p} for m in kv for p in m["pinned"]]}
           if any(m["pinned"] for m in kv) else {}),
        "up": sum(1 for m in kv if m["healthy"]),
        "epochs": {m["name"]: m["epoch"] for m in kv},
    }


def compact(counts: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in counts.items() if v) or "-"


def format_row(r: dict) -> str:
    if "error" in r:
        return f"  {r['t']:7.1f}s  status unavailable: {r['error']}"
    return (f"  {r['t']:7.1f}s {r['inflight']:8} {r['kv_pages_used']:8} "
            f"{r['transfer_failed']:6} {r['pinned']:6} {r['up']:3}  "
            f"{r['aborts']} ({compact(r['aborts_by_reason'])})")


TIMELINE_HEADER = ("timeline (every ~1 s; xfail and aborts include restarted members' "
                   "earlier lives):\n         t inflight kv_pages xfail pinned  up  "
                   "aborts (by reason)")


class Timeline:
    """Samples `collect()` every 100 ms and prints a line about every second, so a storm
    running for minutes shows where it is and a wedge is visible while it happens."""

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.started = time.monotonic()
        self.rows: list[dict] = []
        self.lives: dict[tuple[str, int], tuple[int, dict[str, int]]] = {}

    def now(self) -> float:
        return time.monotonic() - self.started

    def last(self) -> dict:
        """The latest successful sample (an empty-mesh row before the first one)."""
        for r in reversed(self.rows):
            if "error" not in r:
                return r
        return row({"members": []}, 0.0)

    async def run(self, stop: anyio.Event) -> None:
        print(TIMELINE_HEADER, flush=True)
        printed = -PRINT_EVERY
        while not stop.is_set():
            try:
                self.rows.append(row(await collect(self.bootstrap), self.now(), self.lives))
            except grpc.aio.AioRpcError as e:  # a storm must outlive a status hiccup
                self.rows.append({"t": round(self.now(), 3), "error": e.code().name})
            if self.rows[-1]["t"] - printed >= PRINT_EVERY:
                printed = self.rows[-1]["t"]
                print(format_row(self.rows[-1]), flush=True)
            await anyio.sleep(SAMPLE_PERIOD)

    def pinned_ever(self) -> int:
        return max((r.get("pinned", 0) for r in self.rows), default=0)


async def wait_quiet(bootstrap: str, since: float, limit: float = 60.0) -> float | None:
    """Seconds from `since` (a monotonic time) until the mesh is quiet; None if it is
    not quiet `limit` seconds after `since` (the figure is then the evidence of a wedge)."""
    while True:
        try:
            if is_quiet(await collect(bootstrap)):
                return time.monotonic() - since
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() - since > limit:
            return None
        await anyio.sleep(0.005)


def count(outcomes: dict[str, int], key: str) -> None:
    outcomes[key] = outcomes.get(key, 0) + 1


def error_kind(e: grpc.aio.AioRpcError) -> str:
    """'refused:CODE' for a full mesh saying so (bounds working), else 'error:CODE'."""
    kind = "refused" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
    return f"{kind}:{e.code().name}"


async def cancel_after(client, after: float, **request) -> str:
    """One greedy ignore_eos request its client cancels after `after` seconds; what became
    of it: cancelled_before_first_token | cancelled_streaming | completed | error_kind."""
    tokens = 0
    with anyio.move_on_after(after) as scope:
        try:
            async for item in client.generate(temperature=0, ignore_eos=True, **request):
                tokens += len(getattr(item, "token_ids", []))
        except grpc.aio.AioRpcError as e:
            return error_kind(e)
    if scope.cancelled_caught:
        return "cancelled_streaming" if tokens else "cancelled_before_first_token"
    return "completed"


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def complete(client: GenerateClient, messages: list[dict[str, str]], max_tokens: int,
                   ) -> tuple[list[int], str, str]:
    """One greedy chat request to its end: (token ids, text, finish reason).
    Raises grpc.aio.AioRpcError when the mesh fails it."""
    ids: list[int] = []
    text: list[str] = []
    reason = ""
    async for item in client.generate(messages=messages, max_tokens=max_tokens,
                                      temperature=0):
        if isinstance(item, Piece):
            ids += item.token_ids
            text.append(item.text)
        elif isinstance(item, Done):
            reason = item.finish_reason
    return ids, "".join(text), reason


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms"
