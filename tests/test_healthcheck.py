"""pdmesh.healthcheck, the compose health probe, against a real TLS bootstrap."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdmesh.certs import role_env, write_set
from pdmesh.localmesh import free_port


def _probe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh.healthcheck", *args],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    certs = write_set(tmp_path_factory.mktemp("certs"))
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_TLS_")}
    process = subprocess.Popen([sys.executable, "-m", "pdmesh.cli", "bootstrap", "--port",
                                str(port)], env={**base, **role_env(certs, "bootstrap")},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield f"127.0.0.1:{port}", base, certs
    process.terminate()
    process.wait(10)


def test_grpc_probe_is_healthy_with_a_certificate_of_the_ca(bootstrap):
    address, base, certs = bootstrap
    env = {**base, **role_env(certs, "bootstrap")}  # a container probes with its own
    deadline = time.monotonic() + 30
    while (out := _probe("grpc", address, env=env)).returncode != 0:
        assert time.monotonic() < deadline, out.stderr
        time.sleep(0.3)


@pytest.mark.parametrize("case", ["plaintext against TLS", "nothing listening", "http"])
def test_probes_fail_in_one_line_without_waiting(bootstrap, case):
    address, base, certs = bootstrap
    args, env = {
        "plaintext against TLS": (("grpc", address), base),
        "nothing listening": (("grpc", f"127.0.0.1:{free_port()}", "--timeout", "2"),
                              {**base, **role_env(certs, "client")}),
        "http": (("http", f"http://127.0.0.1:{free_port()}/health"), base),
    }[case]
    started = time.monotonic()
    out = _probe(*args, env=env)
    assert out.returncode == 1 and time.monotonic() - started < 10
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unhealthy" in lines[0], out.stderr
