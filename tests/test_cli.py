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


MODELOPT_TINY = "tests/engine/data/modelopt_tiny_w4a16"  # vocab 256, no tokenizer files


def test_up_refuses_a_model_that_is_not_one_before_starting_anything():
    out = run("up", "--model", "/no/such/model", "--http-port", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("pdmesh up: --model: '/no/such/model' is not a model")
    assert "starting" not in out.stderr  # the supervisor never ran


def test_up_refuses_a_tokenizer_larger_than_the_vocabulary():
    # Served, every request naming a token >= 256 would fail (it did: 503s from a green mesh).
    out = run("up", "--model", MODELOPT_TINY)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "the tokenizer has 49152 tokens but the model's vocabulary only 256" in out.stderr
    assert "add the model's tokenizer.json" in out.stderr


@pytest.mark.parametrize("command", ["router", "prefill"])
def test_a_service_started_by_hand_says_why_in_one_line(command):
    model = MODELOPT_TINY if command == "router" else "/no/such/model"
    out = run(command, "--model", model, "--bootstrap", "127.0.0.1:1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"pdmesh {command}: --model" in out.stderr.splitlines()[-1]


@pytest.mark.parametrize("argv", [
    ["router", "--max-queue", "0"],
    ["router", "--max-queue", "-3"],
    ["router", "--queue-timeout", "0"],
    ["up", "--model", "tiny", "--router-args", "--max-queue 0"],
])
def test_a_queue_bound_below_one_is_one_line_and_exit_2(argv):
    out = run(*argv)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "--max-queue" in last or "--queue-timeout" in last, out.stderr
    assert "starting" not in out.stderr  # nothing was started


@pytest.mark.parametrize("argv, flag", [
    (["router", "--max-preemptions", "-1"], "--max-preemptions"),
    (["router", "--max-n", "0"], "--max-n"),
    (["router", "--max-top-logprobs", "65"], "--max-top-logprobs"),
    (["router", "--max-top-logprobs", "two"], "--max-top-logprobs"),
])
def test_a_request_bound_out_of_range_is_a_usage_error(argv, flag):
    out = run(*argv)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert flag in last and ("must be" in last or "not an integer" in last), out.stderr
