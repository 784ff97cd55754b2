"""The command line: --help everywhere, one clear line and exit code 2 for bad flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = [
    "up", "bootstrap", "prefill", "decode", "router", "status", "generate", "bench", "debug",
]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_top_level_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for command in COMMANDS:
        assert command in out.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_answers_help(command):
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: pdmesh" in out.stdout


def test_bad_flag_is_one_clear_line_and_exit_2():
    out = run("up", "--no-such-flag")
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr
    assert "Traceback" not in out.stderr


def test_status_without_bootstrap_is_a_clear_error():
    out = run("status", "--bootstrap", "127.0.0.1:1")
    assert out.returncode == 1
    assert "unreachable" in out.stderr and "Traceback" not in out.stderr
