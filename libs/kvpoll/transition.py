"""The pure transition rule: given a current and a requested state, what happens.

Kept free of time, I/O and objects so that property tests can drive it exhaustively and
every writer (abort path, transfer poller, deadline sweep) goes through the same rule.
"""

from __future__ import annotations

from enum import Enum

from libs.kvpoll.states import RANK, RoomState


class Outcome(Enum):
    """Result of a transition attempt; returned, never raised, so racing writers are harmless."""

    APPLIED = "applied"
    IGNORED_TERMINAL = "ignored_terminal"
    REFUSED_BACKWARD = "refused_backward"


def decide(current: RoomState, target: RoomState) -> Outcome:
    """Decide a transition from ``current`` to ``target``.

    - A terminal ``current`` absorbs everything, including a second Failed (so the first
      cause wins) and a late Success (so a success after a failure stays a failure).
    - Failed and Success are reachable from every non-terminal state.
    - Among non-terminal states, forward (or skipping forward) and staying put (a progress
      touch, e.g. one more chunk while Transferring) apply; backward is refused.
    """
    if current.terminal:
        return Outcome.IGNORED_TERMINAL
    if target.terminal:
        return Outcome.APPLIED
    if RANK[target] >= RANK[current]:
        return Outcome.APPLIED
    return Outcome.REFUSED_BACKWARD
