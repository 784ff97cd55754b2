"""Start a real local mesh (`pdmesh up` as a subprocess, real ports, real NIXL): for tests,
benchmarks and load generators."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import anyio

from pdmesh.status import collect


def free_port() -> int:
    """A port nothing is bound to now, BELOW the kernel's ephemeral range.

    A mesh's members bind port 0, which the kernel serves from the ephemeral range; a port
    picked there (by binding 0 and letting go) can be handed to one of them before the
    router binds it, and the router's HTTP port then answers with a member's gRPC
    (HTTP/2) bytes (docs/incidents.md). Below the range only another explicit choice can
    collide, and each candidate is checked by binding it."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, as free_port picks them."""
    low = _ephemeral_low()
    rng = random.Random()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 16384), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"found only {len(ports)} free ports below {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return max(low, 2048)


@dataclass
class Mesh:
    process: subprocess.Popen
    log_path: Path
    http_port: int
    grpc_port: int
    bootstrap_port: int
    model: str
    certs: Path | None = None  # the `pdmesh certs` set it runs with; None: --insecure

    def env(self, role: str = "client") -> dict[str, str]:
        """os.environ plus PDMESH_TLS_* for `role` (a CLI client, or a member that joins
        this mesh); without the TLS variables for an insecure mesh."""
        from libs.rpc.tls import CA_ENV, CERT_ENV, KEY_ENV
        from pdmesh.certs import role_env

        env = {k: v for k, v in os.environ.items() if k not in (CERT_ENV, KEY_ENV, CA_ENV)}
        return env if self.certs is None else {**env, **role_env(self.certs, role)}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.bootstrap_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict:
        """What `pdmesh status --json` prints (collected in-process: a CLI start costs 2 s)."""
        return anyio.run(collect, self.bootstrap)

    def status_cli(self) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "pdmesh.cli", "status", "--json", "--bootstrap", self.bootstrap],
            capture_output=True, text=True, timeout=60, check=True, env=self.env(),
        )
        return json.loads(out.stdout)

    def children(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True
        )
        return [int(p) for p in out.stdout.split()]

    def pid_of(self, command: str) -> int:
        """The pid of the child running `pdmesh COMMAND` (bootstrap, prefill, decode, router)."""
        for pid in self.children():
            args = subprocess.run(
                ["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True
            ).stdout
            if f" {command} " in args:
                return pid
        raise LookupError(command)

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                raise


def start_mesh(
    tmp: Path, model: str = "tiny", prefill: int = 1, decode: int = 1, timeout: float = 180.0,
    extra_env: dict[str, str] | None = None, device: str = "cpu", dtype: str = "float32",
    up_args: list[str] | None = None, wait_healthy: bool = True,
) -> Mesh:
    """Start `pdmesh up` and wait until the router's /health is 200 and the members are up.

    ``wait_healthy=False``: wait only until the prefills and decodes are healthy and the
    router is registered; for meshes that must not be able to serve (e.g. members whose KV
    layouts do not pair), whose /health stays 503.
    """
    up_args, certs = _with_tls(tmp, list(up_args or []))
    http_port, grpc_port, boot = free_ports(3)
    log_path = tmp / f"mesh-{Path(model).name}-{prefill}x{decode}.log"  # model may be a path
    # The mesh gets SIGTERM if this process dies (a crashed test run must not leave a mesh
    # behind); `pdmesh up` arms that itself, see pdmesh.cli._die_with_parent.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDMESH_PARENT_PID": str(os.getpid()),
           **(extra_env or {})}
    process = subprocess.Popen(
        [
            sys.executable, "-m", "pdmesh.cli", "up", "--model", model, "--device", device,
            "--dtype", dtype,
            "--prefill", str(prefill), "--decode", str(decode),
            "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--bootstrap-port", str(boot), *up_args,
        ],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env,
    )
    mesh = Mesh(process, log_path, http_port, grpc_port, boot, model, certs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"pdmesh up exited early:\n{mesh.log()[-4000:]}")
        if (not wait_healthy or _health(http_port)) and _members_ready(mesh, prefill, decode):
            return mesh
        time.sleep(0.2)
    mesh.stop()
    raise TimeoutError(f"mesh not healthy in {timeout}s:\n{mesh.log()[-4000:]}")


_certs: Path | None = None


def _with_tls(tmp: Path, up_args: list[str]) -> tuple[list[str], Path | None]:
    """Run the mesh as `pdmesh up` does by default, mutual TLS on every hop, and make this
    process its client (libs.rpc.tls.use_for_clients: status(), every GenerateClient;
    the environment is left alone, so a service or server this process starts is not
    handed a client's certificate). One certificate set per process, so starting a mesh
    costs no key generation. `--insecure` in up_args: plaintext, no client certificate."""
    global _certs
    from libs.rpc import tls
    from pdmesh.certs import role_env, write_set

    if "--insecure" in up_args:
        tls.use_for_clients(None)
        return up_args, None
    if "--certs" not in up_args:
        if _certs is None or not _certs.exists():
            _certs = write_set(tmp / "certs")
        up_args = ["--certs", str(_certs), *up_args]
    directory = Path(up_args[up_args.index("--certs") + 1])
    tls.use_for_clients(tls.from_env(role_env(directory, "client")))
    return up_args, directory


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # not up yet, or not HTTP on that port
        return False


def _members_ready(mesh: Mesh, prefill: int, decode: int) -> bool:
    try:
        members = mesh.status()["members"]
    except Exception:
        return False
    roles = [m["role"] for m in members if m["healthy"]]
    # The router is only registered: its health is the mesh's (can it pair?).
    return (roles.count("prefill") >= prefill and roles.count("decode") >= decode
            and any(m["role"] == "router" for m in members))


def wait_quiet(mesh: Mesh, timeout: float = 5.0) -> dict:
    """Wait until every member reports inflight 0 and no KV page used; returns the status."""
    deadline = time.monotonic() + timeout
    while True:
        status = mesh.status()
        busy = [
            m for m in status["members"]
            if m["role"] in ("prefill", "decode") and (m["inflight"] or m["kv_pages_used"])
        ]
        if not busy:
            return status
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    raise AssertionError(f"mesh not quiescent after {timeout}s: {json.dumps(status)}")
