"""Start-up refusals: a device that is not there is one line and exit code 2, from
`pdmesh up` before any child starts, and from a member `pdmesh up` started, which then
stops the whole mesh instead of restarting the member forever."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdmesh.localmesh import free_ports

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@no_gpu
def test_up_on_cuda_without_a_gpu_is_one_line_and_exit_2_before_anything_starts():
    out = run("up", "--device", "cuda", "--model", "tiny")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("pdmesh up: --device cuda: no CUDA device is visible")
    assert len(out.stderr.splitlines()) == 1 and "starting" not in out.stderr


def test_a_prefill_or_decode_device_that_is_not_here_is_refused_by_up():
    """--prefill-device / --decode-device are checked like --device, each naming its flag."""
    out = run("up", "--model", "tiny", "--decode-device", "cuda:x")
    assert out.returncode == 2
    assert out.stderr.strip() == ("pdmesh up: --decode-device cuda:x: 'cuda:x' is not a "
                                  "device: use cpu, cuda or cuda:N")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, on any machine
    out = run("up", "--model", "tiny", "--prefill-device", missing)
    assert out.returncode == 2 and out.stderr.startswith(f"pdmesh up: --prefill-device {missing}: ")
    assert len(out.stderr.splitlines()) == 1 and "starting" not in out.stderr


def test_a_device_that_is_no_device_is_refused_by_up_and_by_a_member():
    out = run("up", "--device", "gpu0", "--model", "tiny")
    assert out.returncode == 2 and "'gpu0' is not a device" in out.stderr
    out = run("decode", "--device", "cuda:x", "--bootstrap", "127.0.0.1:1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == \
        "pdmesh decode: --device cuda:x: 'cuda:x' is not a device: use cpu, cuda or cuda:N"


@no_gpu
def test_a_member_that_cannot_start_stops_the_mesh_with_its_exit_code():
    http, grpc_port, boot = free_ports(3)
    out = run("up", "--model", "tiny", "--decode-args", "--device cuda",
              "--http-port", str(http), "--grpc-port", str(grpc_port),
              "--bootstrap-port", str(boot), timeout=90)
    assert out.returncode == 2
    assert "pdmesh decode: --device cuda: no CUDA device is visible" in out.stderr
    assert "decode-0 cannot start here (exit code 2" in out.stderr
    assert "restart #" not in out.stderr and "all services stopped" in out.stderr
    assert "SystemExit" not in out.stderr
