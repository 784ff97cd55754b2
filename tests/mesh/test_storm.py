"""`pdmesh storm --mode abort` against a real mesh: every wave quiesces, verdict PASS."""

from __future__ import annotations

import json
import subprocess
import sys


def test_small_abort_storm_passes(tiny_mesh, tmp_path):
    out = tmp_path / "storm.json"
    run = subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "storm", "--mode", "abort",
         "--router", tiny_mesh.router, "--bootstrap", tiny_mesh.bootstrap,
         "--waves", "3", "--concurrency", "12", "--prompt-words", "200",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "verdict: PASS" in run.stdout
    result = json.loads(out.read_text())
    assert len(result["quiesce_s"]) == 3 and max(result["quiesce_s"]) <= 1.0
    cancelled = sum(v for k, v in result["outcomes"].items() if k.startswith("cancelled"))
    assert cancelled >= 30  # the storm really aborted requests mid-flight
