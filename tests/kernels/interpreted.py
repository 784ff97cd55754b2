"""Triton kernel tests without a GPU: the module's tests run again, under Triton's
interpreter, in a fresh process (the interpreter is chosen when triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
# Without a GPU the kernel tests run in run_module_interpreted's subprocess.
kernels = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="run under the interpreter")


def run_module_interpreted(test_file: str) -> None:
    """Run `test_file`'s tests under TRITON_INTERPRET=1; skipped where they run here."""
    if CUDA or INTERPRETED:
        pytest.skip("running them in this process")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout + proc.stderr
