"""The benchmarks run from the installed packages alone: no sys.path edits, no repository root.

The subprocess sees only the top-level packages pyproject.toml installs (linked into a
temporary directory) and runs from elsewhere, so an import of ``bench`` or ``tests``, or a
path computed from the repository's layout, fails here as it would after ``pip install``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

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
