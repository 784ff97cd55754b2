"""Score stored NVFP4 kernel benches against issue 5's targets: prints a table, writes JSON.

    python -m bench.nvfp4_targets [FILE ...] [--device H200] [--last N] [--out F]

Reads JSON written by `bench.nvfp4_kernels_bench` (by default every
`docs/notes/bench/nvfp4_kernels-*.json`), keeps the runs on the named card, and scores the
last N by their recorded time. The targets, as the issue states them:
- quantize and dequantize: at least 80% of the copy bandwidth measured in the same run;
- nvfp4_linear at M = 1 on the large shapes (4096x4096 and up): at least 3.0x torch bf16;
- nvfp4_linear at M = 256, every shape: at least 1.0x torch bf16.

One bench run is one sample of a noisy card (torch alone moves a few percent between
runs), so a row is judged over runs: met in all, some or none. Where a run kept its
interleaved rounds, the range of the per-round ratios is shown beside the median.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

COPY_SHARE = 80.0  # % of the copy, quantize and dequantize
M1_SPEEDUP = 3.0  # M = 1, large shapes
M256_SPEEDUP = 1.0  # M = 256, every shape
LARGE = 4096 * 4096  # weights; the "large shapes" are 4096x4096 and 8192x28672
STORED = Path(__file__).resolve().parents[1] / "docs" / "notes" / "bench"


@dataclass(frozen=True)
class Score:
    target: str  # e.g. "quantize bfloat16 % copy" or "4096x4096 M=1 speedup"
    threshold: float
    value: float
    low: float | None = None  # the lowest per-round value, where rounds were kept
    high: float | None = None

    @property
    def met(self) -> bool:
        return self.value >= self.threshold


def score_run(run: dict) -> list[Score]:
    """Every target row one bench run can speak to, in the issue's order."""
    scores = [
        Score(f"{row['op']} {row['dtype']} % copy", COPY_SHARE, row["pct_copy"])
        for row in run.get("stream", [])
    ]
    for row in run.get("linear", []):
        if row["m"] == 1 and row["n"] * row["k"] >= LARGE:
            threshold = M1_SPEEDUP
        elif row["m"] == 256:
            threshold = M256_SPEEDUP
        else:
            continue  # M = 16 and 64, and M = 1 on small shapes, have no target
        rounds = row.get("rounds") or {}  # the bench's own per-round range, where it kept rounds
        low, high = rounds.get("speedup_min"), rounds.get("speedup_max")
        name = f"{row['n']}x{row['k']} ({row['shape']}) M={row['m']} speedup"
        scores.append(Score(name, threshold, row["speedup"], low, high))
    return scores


def load_runs(paths: list[str], device: str, last: int) -> list[tuple[str, dict]]:
    """The last `last` runs on a card whose name holds `device`, oldest first."""
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        if device.lower() in str(run.get("device", "")).lower() and run.get("linear"):
            runs.append((os.path.basename(path), run))
    runs.sort(key=lambda item: item[1].get("time", ""))
    return runs[-last:] if last > 0 else runs


def scoreboard(runs: list[tuple[str, dict]]) -> list[dict]:
    """One entry a target: its value in every run that measured it, and the verdict."""
    table: dict[str, dict] = {}
    for name, run in runs:
        for s in score_run(run):
            entry = table.setdefault(s.target, {"target": s.target, "threshold": s.threshold,
                                                "runs": []})
            entry["runs"].append({"run": name, "value": s.value, "low": s.low,
                                  "high": s.high, "met": s.met})
    for entry in table.values():
        met = sum(r["met"] for r in entry["runs"])
        entry["met_in"] = f"{met}/{len(entry['runs'])}"
        entry["verdict"] = ("met" if met == len(entry["runs"])
                            else "missed" if met == 0 else "some runs")
        entry["median"] = statistics.median(r["value"] for r in entry["runs"])
    return list(table.values())


def _cell(r: dict, threshold: float) -> str:
    """A speedup to three decimals (1.003 is not 1.0), a share of the copy to one."""
    f = ".1f" if threshold >= COPY_SHARE else ".3f"
    mark = "" if r["met"] else "*"
    if r["low"] is None:
        return f"{r['value']:{f}}{mark}"
    return f"{r['value']:{f}}{mark} ({r['low']:{f}}-{r['high']:{f}})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="bench JSON files (default: the stored ones)")
    ap.add_argument("--device", default="H200", help="keep runs on cards whose name holds this")
    ap.add_argument("--last", type=int, default=6, help="score the last N runs (0: all)")
    ap.add_argument("--out", default="", help="write the scoreboard here as JSON")
    args = ap.parse_args(argv)
    paths = args.files or sorted(glob.glob(str(STORED / "nvfp4_kernels-*.json")))
    runs = load_runs(paths, args.device, args.last)
    if not runs:
        ap.error(f"no bench run on a {args.device} among {len(paths)} file(s)")
    board = scoreboard(runs)
    print(f"{len(runs)} run(s) on {args.device}, oldest first; * = under the target; "
          "(per-round range) where rounds were kept")
    for i, (name, run) in enumerate(runs):
        print(f"  run {i + 1}: {name} ({run.get('time', '?')})")
    width = max(len(e["target"]) for e in board)
    for e in board:
        cells = "  ".join(_cell(r, e["threshold"]) for r in e["runs"])
        print(f"{e['target']:<{width}}  >= {e['threshold']:<4g} {e['verdict']:<9} "
              f"{e['met_in']:>5}  {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": [name for name, _ in runs], "targets": board}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
