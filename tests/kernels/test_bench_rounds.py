"""bench.rounds: torch and nvfp4 alternate round by round, so drift hits both alike."""

from bench.rounds import interleaved


def test_timers_alternate_round_by_round():
    log = []
    timers = [lambda: log.append("torch") or 1.0, lambda: log.append("nvfp4") or 2.0]
    times = interleaved(timers, 3)
    assert log == ["torch", "nvfp4"] * 3
    assert times == [[1.0] * 3, [2.0] * 3]


def test_one_round_times_each_once():
    calls = []
    assert interleaved([lambda: calls.append(0) or 5.0], 1) == [[5.0]]
    assert calls == [0]
