"""Every bound a request's lifecycle waits under, in one place, with the order they keep.

Imports nothing of the mesh, so the router (which never loads torch), the prefill and the
decode all read the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Timeouts:
    """The lifecycle's timeouts in seconds (``fence_attempts`` is a count).

    Some of them only make sense in a given order, and a set that breaks it is refused
    with a ValueError when it is built:

    - **Each deadline has a margin.** The router's legs end ``deadline_margin`` before its
      gRPC caller's deadline, and the decode's KV wait ends ``kv_wait_margin`` before its
      call's deadline (at most a quarter of the budget, see :meth:`kv_wait`). So a late
      request fails typed, as ``deadline``, on the member's terms, instead of racing its
      caller's cancellation. Both margins are positive.
    - **A fence ends inside its release.** The prefill fences every posted write within
      ``fence_seconds``; the shield around its whole release, ``prefill_release_seconds``,
      is longer, so a fence that times out still ends in the release's own bookkeeping
      (unfenced pages withheld, the room removed) rather than being cut short.
    - **An Abort outwaits a release.** A member's Abort waits ``abort_wait_seconds`` for
      the request's release before it answers, no less than the prefill's fence budget
      and the decode's ``decode_release_seconds`` (one decode step letting go of the
      sequence): a release that ends within its own bound is acknowledged as released.
    - **The ack comes before the call's deadline.** A decode fencing a quarantined room
      calls its writer's Abort with ``writer_abort_seconds``, longer than the writer's
      own wait, so the writer's AbortAck (released or not) comes back instead of
      DEADLINE_EXCEEDED. It asks ``fence_attempts`` times, ``fence_backoff * 2**k``
      seconds apart; after that the pages stay quarantined (never reused on a timeout).

    The rest bound a single wait and need only be positive: the router's Aborts
    (``abort_seconds``, short, because a failed request's cleanup must not hold its
    caller; a member whose ack comes later fences on its own), the router's wait for
    the decode's KvArrived after the prefill's TransferResult (``kv_arrival_grace``: a
    lost notification is reported, not waited out), a cancelled prefill's wait for its
    chunk already in a forward pass (``finish_seconds``), the time queued work may see
    no progress before health turns NOT_SERVING (``prefill_stall_seconds``,
    ``decode_stall_seconds``; ``--stall-after`` sets it per member), and the time a live
    room may see no state change before status reports it pinned (``pinned_after``,
    ``--pinned-after``: long enough that a request queued behind a busy member is not
    flagged; vLLM's KV lease is 30 s too).
    """

    # router
    deadline_margin: float = 0.1
    kv_arrival_grace: float = 5.0
    abort_seconds: float = 2.0
    # decode
    kv_wait_margin: float = 0.5
    decode_release_seconds: float = 2.0
    writer_abort_seconds: float = 6.0
    fence_attempts: int = 5
    fence_backoff: float = 0.2
    decode_stall_seconds: float = 30.0
    # prefill
    fence_seconds: float = 5.0
    prefill_release_seconds: float = 6.0
    finish_seconds: float = 60.0
    prefill_stall_seconds: float = 60.0
    # both
    abort_wait_seconds: float = 5.0
    pinned_after: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"Timeouts.{f.name} must be positive, got {getattr(self, f.name)}")
        self._ordered("fence_seconds", "<", "prefill_release_seconds",
                      "a fence that times out must end inside the prefill's release")
        self._ordered("fence_seconds", "<=", "abort_wait_seconds",
                      "an Abort must wait at least as long as the prefill's fence")
        self._ordered("decode_release_seconds", "<=", "abort_wait_seconds",
                      "an Abort must wait at least as long as the decode's release")
        self._ordered("abort_wait_seconds", "<", "writer_abort_seconds",
                      "the writer's AbortAck must come before the decode's call gives up")

    def _ordered(self, low: str, op: str, high: str, why: str) -> None:
        a, b = getattr(self, low), getattr(self, high)
        if not (a < b if op == "<" else a <= b):
            raise ValueError(f"Timeouts: {low} ({a}) must be {op} {high} ({b}): {why}")

    def kv_wait(self, budget: float) -> float:
        """How long the decode waits for a request's KV when its call has ``budget``
        seconds: less than the budget, so time is left to generate, or to fail typed."""
        return budget - min(self.kv_wait_margin, budget / 4)

    def leg_budget(self, remaining: float) -> float:
        """The budget of the router's legs when its gRPC caller has ``remaining`` seconds."""
        return max(0.01, remaining - self.deadline_margin)


TIMEOUTS = Timeouts()
