"""bench.nvfp4_targets: each bench row is judged against the issue's own thresholds."""

import json

from bench.nvfp4_targets import STORED, load_runs, main, score_run, scoreboard


def _linear(n, k, m, speedup, rounds=None):
    row = {"shape": f"{n}x{k}", "n": n, "k": k, "m": m, "speedup": speedup}
    if rounds:  # as bench.nvfp4_kernels_bench records them
        ratios = sorted(t / n_ for t, n_ in rounds)
        row["rounds"] = {"bf16_us": [t for t, _ in rounds], "nvfp4_us": [n_ for _, n_ in rounds],
                         "speedup_min": ratios[0], "speedup_max": ratios[-1]}
    return row


def _run(time, quantize_pct, square_m1, gate_up_m256, device="NVIDIA H200"):
    return {
        "device": device, "time": time,
        "stream": [{"op": "quantize", "dtype": "bfloat16", "pct_copy": quantize_pct}],
        "linear": [
            _linear(576, 576, 1, 1.3),  # small shape at M = 1: no target
            _linear(4096, 4096, 16, 1.5),  # M = 16: no target
            _linear(4096, 4096, 1, square_m1, rounds=[(13.0, 6.5), (13.2, 6.0)]),
            _linear(1536, 576, 256, gate_up_m256),
        ],
    }


def test_rows_get_the_issues_thresholds_and_only_those():
    scores = {s.target: s for s in score_run(_run("t", 79.9, 3.0, 1.0))}
    assert sorted(scores) == ["1536x576 (1536x576) M=256 speedup",
                              "4096x4096 (4096x4096) M=1 speedup",
                              "quantize bfloat16 % copy"]
    assert not scores["quantize bfloat16 % copy"].met  # 79.9 < 80
    assert scores["4096x4096 (4096x4096) M=1 speedup"].met  # exactly 3.0 counts
    assert scores["4096x4096 (4096x4096) M=1 speedup"].threshold == 3.0
    assert scores["1536x576 (1536x576) M=256 speedup"].met
    square = scores["4096x4096 (4096x4096) M=1 speedup"]
    assert (square.low, round(square.high, 9)) == (2.0, 2.2)  # per-round torch / nvfp4


def test_verdicts_over_runs():
    board = {e["target"]: e for e in scoreboard([("a", _run("1", 81.0, 2.0, 0.99)),
                                                   ("b", _run("2", 80.5, 2.1, 1.01))])}
    assert board["quantize bfloat16 % copy"]["verdict"] == "met"
    assert board["4096x4096 (4096x4096) M=1 speedup"]["verdict"] == "missed"
    gate_up = board["1536x576 (1536x576) M=256 speedup"]
    assert (gate_up["verdict"], gate_up["met_in"]) == ("some runs", "1/2")


def test_runs_are_filtered_by_card_and_ordered_by_time(tmp_path):
    paths = []
    for name, run in [("late", _run("2026-12-06 09:00", 81, 2, 1)),
                      ("h100", _run("2026-12-06 10:00", 81, 2, 1, device="NVIDIA H100 80GB")),
                      ("early", _run("2026-12-03 09:00", 81, 2, 1))]:
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    assert [n for n, _ in load_runs([str(p) for p in paths], "H200", 0)] == ["early.json",
                                                                             "late.json"]
    assert [n for n, _ in load_runs([str(p) for p in paths], "H200", 1)] == ["late.json"]


def test_a_stored_h200_run_is_scored_as_recorded(tmp_path, capsys):
    """The session `tma-slices` run 2 on an H200: bf16 quantize at 79.8% of the copy and
    4096x4096 at M = 1 at 2.07x, both under their targets; 8192x28672 at M = 1 over."""
    out = tmp_path / "board.json"
    stored = STORED / "nvfp4_kernels-tma-slices-h200-run2.json"
    assert main([str(stored), "--out", str(out)]) == 0
    board = {e["target"]: e for e in json.loads(out.read_text())["targets"]}
    quantize = board["quantize bfloat16 % copy"]["runs"][0]
    assert round(quantize["value"], 1) == 79.8 and not quantize["met"]
    square = board["4096x4096 (square 4096) M=1 speedup"]["runs"][0]
    assert round(square["value"], 2) == 2.07 and not square["met"]
    assert board["8192x28672 (large 8192x28672) M=1 speedup"]["runs"][0]["met"]
    assert "missed" in capsys.readouterr().out
