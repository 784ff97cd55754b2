"""`pdmesh bench`: it runs from the installed packages alone (no sys.path edits, no
repository root), a tiny run reports its three sides, and flags that cannot work are one
line and exit code 2.

The help check's subprocess sees only the top-level packages pyproject.toml installs
(linked into a temporary directory) and runs from elsewhere, so an import of ``bench`` or
``tests``, or a path computed from the repository's layout, fails there as it would after
``pip install``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib.util, runpy, sys
assert importlib.util.find_spec("bench") is None and importlib.util.find_spec("tests") is None
for module, args in [("pdmesh.bench.mesh", []), ("pdmesh.bench.transfer", []),
                     ("pdmesh.bench.engine", []), ("pdmesh.cli", ["bench"])]:
    sys.argv = [module, *args, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code == 0, (module, e.code)
"""


def installed_packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]]


def test_bench_modules_answer_help_from_the_installed_packages_alone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    for name in installed_packages():
        (site / name).symlink_to(ROOT / name)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert out.returncode == 0, out.stderr
    for usage in ("python -m pdmesh.bench.mesh", "python -m pdmesh.bench.transfer",
                  "python -m pdmesh.bench.engine", "pdmesh bench"):
        assert f"usage: {usage}" in out.stdout
    assert "--skip-transfer" in out.stdout and "KV transfer GB/s" in out.stdout


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "bench", "--out", str(tmp_path / "b.json"), *args],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )


def test_a_tiny_bench_reports_three_sides_of_every_workload(tmp_path):
    import json

    out = bench(tmp_path, "--model", "tiny", "--tokens", "6", "--requests", "3",
                "--concurrency", "2", "--prompt-len", "12:30", "--output-len", "3:6",
                "--prompt-tokens", "200", "--reps", "1", "--skip-transfer")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["sides"]) == {"transformers", "engine", "mesh"}
    assert result["workloads"]["multi"]["requests"] == 3
    assert result["workloads"]["multi"]["arrivals"] == "closed loop, concurrency 2"
    for side in result["sides"].values():
        for scenario in ("single", "multi", "ttft"):
            (run,) = side["runs"][scenario]
            assert run["completed"] == run["requests"] and not run["errors"]
            for figure in ("ttft_s", "e2e_s"):
                assert set(run[figure]) == {"mean", "p50", "p90", "p99", "max"}
                assert 0 < run[figure]["p50"] <= run[figure]["p99"]
            assert run["output_tok_s"] > 0
        assert side["best"]["multi"]["itl_s"]["p50"] > 0
    mesh = result["sides"]["mesh"]["runs"]["multi"][0]
    assert mesh["kv_transfer"]["rooms"] == 3 and mesh["kv_transfer"]["bytes"] > 0
    assert "decode-0" in mesh["cpu_s"]
    steps = mesh["decode_steps"]  # 3 requests of 3-6 tokens: a few steps, every part timed
    assert steps["steps"] >= 2 and set(steps["ms"]) == {
        "prepare", "dispatch", "compute", "resume", "handoff"}
    assert steps["ms"]["compute"] > 0 and all(v >= 0 for v in steps["ms"].values())
    assert "mesh decode steps during multi" in out.stdout
    assert result["sides"]["engine"]["breakdown"]["decode_step_b1_ms"] > 0
    rows = {r["metric"]: r for r in result["summary"]}
    row = rows["3 req x2 aggregate tok/s"]
    assert all(row[side] > 0 for side in ("transformers", "engine", "mesh"))
    assert row["mesh_vs_engine"] == pytest.approx(row["mesh"] / row["engine"])
    assert result["greedy_agreement"]["mesh_vs_engine"]["multi"] == {"compared": 3, "equal": 3}
    assert "mesh/eng" in out.stdout and "3 req x2 TTFT p50 ms" in out.stdout


@pytest.mark.parametrize("flags, says", [
    (["--prompt-len", "0:5"], "pdmesh bench: --prompt-len: '0:5': need 1 <= A <= B"),
    (["--model", "tiny", "--prompt-tokens", "4000"], "passes tiny's context of 2048"),
    (["--device", "npu"], "pdmesh bench: --device npu: 'npu' is not a device"),
])
def test_a_bench_that_cannot_run_says_why_in_one_line(tmp_path, flags, says):
    out = bench(tmp_path, *flags)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert says in out.stderr and len(out.stderr.splitlines()) == 1
