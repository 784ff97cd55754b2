"""Faults on real links (bench.netfaults): bootstrap, prefill, decode and router in their
own network namespaces, NIXL over TCP between them, an abort storm, and each fault in
turn; where namespaces cannot be made, or a fault needs what the host lacks (tc netem,
nftables), the loopback TCP fault proxy covers it. Select with `pytest -m net`; about
two minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netfaults import namespaces
from bench.netfaults.scenario import FAULTS

pytestmark = pytest.mark.net

ALL = [f.kind for f in FAULTS]
NO_NAMESPACES = namespaces.unavailable()
UNSUPPORTED = {} if NO_NAMESPACES else namespaces.unsupported_faults()  # kind -> why


def _run(tmp_path: Path, *flags: str, env: dict[str, str] | None = None
         ) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "bench.netfaults", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=560,
                          env={**os.environ, **(env or {})})
    return proc, json.loads(out.read_text()) if out.exists() else None


def _assert_every_row_passed(result: dict, faults: list[str], output: str) -> None:
    names = {f.name for f in FAULTS if f.kind in faults}
    assert {r["fault"] for r in result["rows"]} == names, output
    for row in result["rows"]:
        if "skipped" in row:
            continue
        failed = [check for check, ok in row["checks"].items() if not ok]
        assert not failed, f"{row['fault']}: {failed}\n{json.dumps(row)}\n{output[-3000:]}"
        assert row["pinned"] == 0 and row["corrupt"] == 0 and row["replay_corrupt"] == 0
        assert row["requests"] > row["aborted"] > 0


@pytest.mark.skipif(NO_NAMESPACES is not None,
                    reason=f"network namespaces unavailable: {NO_NAMESPACES}; "
                    "test_faults_behind_the_loopback_proxy covers the same faults")
def test_faults_across_network_namespaces(tmp_path):
    proc, result = _run(tmp_path, "--mode", "netns")
    output = proc.stdout + proc.stderr
    assert result is not None, output
    assert result["mode"] == "netns"
    _assert_every_row_passed(result, ALL, output)
    skipped = {r["fault"]: r["skipped"] for r in result["rows"] if "skipped" in r}
    # only what this host lacks (netem: delay; nftables: loss, partition) is skipped, and
    # the proxy test below covers it
    assert set(skipped) == {f.name for f in FAULTS if f.kind in UNSUPPORTED}
    frozen = next(r for r in result["rows"] if "SIGSTOP" in r["fault"])
    assert frozen["frozen_rooms_failed_s"] is not None
    assert proc.returncode == 0, output


def test_faults_behind_the_loopback_proxy(tmp_path):
    if NO_NAMESPACES is None and not UNSUPPORTED:
        pytest.skip("namespaces, tc netem and nftables cover every fault here")
    # every fault without namespaces; beside them, only what they cannot make here
    faults = ALL if NO_NAMESPACES else [k for k in ALL if k in UNSUPPORTED]
    proc, result = _run(tmp_path, "--mode", "proxy", "--faults", ",".join(faults))
    output = proc.stdout + proc.stderr
    assert result is not None and result["mode"] == "proxy", output
    assert not any("skipped" in r for r in result["rows"])
    _assert_every_row_passed(result, faults, output)
    assert proc.returncode == 0, output


def test_a_namespace_that_cannot_be_created_is_one_line(tmp_path):
    """Without iproute2 (or without the right to make namespaces), --mode netns stops at
    once with one line saying why; a topology that fails half way leaves nothing."""
    proc, result = _run(tmp_path, "--mode", "netns", env={"PATH": str(tmp_path)})
    assert proc.returncode != 0 and result is None
    lines = proc.stderr.strip().splitlines()
    assert lines == ["bench.netfaults: --mode netns: the `ip` command (iproute2) is not "
                     "installed"], proc.stderr
    if NO_NAMESPACES is not None:
        return
    bad = namespaces.Topology("bad/name", 250)  # "/" is not allowed in a namespace name
    with pytest.raises(namespaces.NamespaceError) as e:
        bad.create()
    assert str(e.value).startswith("`ip netns add pdmbad/name-hub` failed: ")
    assert "\n" not in str(e.value)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "pdmbad" not in listed
