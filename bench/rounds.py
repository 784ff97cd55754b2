"""Interleaved timing rounds: the benches' guard against a noisy card.

Torch's own time moves by several percent from run to run on one machine (8192x28672
at M = 1 on an H200: 112-130 us), so one torch/nvfp4 pair can land on either side of a
target ratio. Timing both alternately, round after round, puts the drift on both alike; the
spread of the per-round ratios then says how firm a ratio is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def interleaved(timers: Sequence[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Run each zero-arg timer `rounds` times, alternating between them; one list of times
    per timer, in round order."""
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(rounds):
        for t, timer in zip(times, timers, strict=True):
            t.append(timer())
    return times
