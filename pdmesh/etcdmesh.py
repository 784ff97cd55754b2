"""A mesh over etcd on this host: an etcd, several bootstrap replicas, members and routers,
each its own process, so any one can be killed, stopped or restarted on its own.

The etcd-backed counterpart of localmesh.start_mesh (which runs `pdmesh up`, one in-memory
bootstrap). Used by tests/mesh/test_mesh_etcd*.py and `python -m pdmesh.etcdmesh` (the
storm against two replicas and two routers). Plaintext gRPC throughout: the processes
talk over loopback only, and TLS is exercised elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.localmesh import free_ports

ETCD_BINARY = "etcd"


def etcd_binary() -> str | None:
    """The etcd server binary (Debian's etcd-server package), or None where there is none."""
    return shutil.which(ETCD_BINARY) or (
        "/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


@dataclass
class EtcdServer:
    """One etcd member on loopback, its data in `directory` (kept across restarts)."""

    directory: Path
    client_port: int = 0
    peer_port: int = 0
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if not self.client_port:
            self.client_port, self.peer_port = free_ports(2)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.address}/pdmesh"

    def start(self, timeout: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd not found (Debian: apt-get install etcd-server)")
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "etcd.log").open("a")
        self.process = subprocess.Popen(
            [binary, "--name", "pdmesh-test", "--data-dir", str(self.directory / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"pdmesh-test={peer}",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.directory / 'etcd.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as reply:
                    if json.load(reply).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("etcd not healthy")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@dataclass
class EtcdMesh:
    """etcd plus `bootstraps` bootstrap replicas, prefills, decodes and `routers` routers."""

    directory: Path
    model: str = "tiny"
    bootstraps: int = 2
    routers: int = 2
    prefill: int = 1
    decode: int = 1
    lease: float = 2.0
    etcd: EtcdServer | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    bootstrap_ports: list[int] = field(default_factory=list)
    router_ports: dict[str, tuple[int, int]] = field(default_factory=dict)  # http, grpc

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.bootstrap_ports)

    def start(self, timeout: float = 120.0) -> EtcdMesh:
        from libs.rpc import tls

        tls.use_for_clients(None)  # plaintext: this process is a client of a plaintext mesh
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.etcd is None:
            self.etcd = EtcdServer(self.directory / "etcd")
            self.etcd.start()
        self.bootstrap_ports = free_ports(self.bootstraps)
        for i in range(self.bootstraps):
            self.start_bootstrap(i)
        member = ["--bootstrap", self.bootstrap, "--model", self.model, "--device", "cpu"]
        for i in range(self.prefill):
            self._spawn(f"prefill-{i}", ["prefill", "--name", f"prefill-{i}", *member])
        for i in range(self.decode):
            self._spawn(f"decode-{i}", ["decode", "--name", f"decode-{i}", *member])
        for i in range(self.routers):
            http, grpc_port = free_ports(2)
            self.router_ports[f"router-{i}"] = (http, grpc_port)
            self._spawn(f"router-{i}", [
                "router", "--name", f"router-{i}", "--bootstrap", self.bootstrap,
                "--model", self.model, "--http-port", str(http), "--grpc-port", str(grpc_port)])
        self.wait_until(lambda: all(self.router_healthy(r) for r in self.router_ports)
                        and len(self.members()) == self.prefill + self.decode + self.routers,
                        timeout, "mesh not healthy")
        return self

    def start_bootstrap(self, index: int) -> None:
        self._spawn(f"bootstrap-{index}", [
            "bootstrap", "--port", str(self.bootstrap_ports[index]), "--store", self.etcd.url,
            "--lease", str(self.lease)])

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("PDMESH_TLS")}
        env.update(PYTHONUNBUFFERED="1", PDMESH_PARENT_PID=str(os.getpid()))
        log = (self.directory / f"{name}.log").open("a")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "pdmesh.cli", *args], stdout=log,
            stderr=subprocess.STDOUT, env=env)

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.processes[name].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.processes[name].wait(15)

    def router_healthy(self, router: str) -> bool:
        http = self.router_ports[router][0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def members(self, bootstrap: int | None = None) -> dict[str, int]:
        """name -> epoch as a live bootstrap replica lists them ({} if none answers);
        from a thread with no event loop (see listed() inside one)."""
        import anyio

        return anyio.run(self.listed, bootstrap)

    async def listed(self, bootstrap: int | None = None) -> dict[str, int]:
        import grpc

        from libs.rpc.calls import open_channel, unary
        from pdmesh.v1 import bootstrap_pb2 as bpb
        from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc

        indices = [bootstrap] if bootstrap is not None else range(len(self.bootstrap_ports))
        for i in indices:
            channel = open_channel(f"127.0.0.1:{self.bootstrap_ports[i]}")
            try:
                reply = await unary(bgrpc.BootstrapStub(channel).ListMembers,
                                    bpb.ListMembersRequest(), timeout=1.0)
                return {m.name: m.epoch for m in reply.members}
            except grpc.aio.AioRpcError:
                continue
            finally:
                await channel.close()
        return {}

    @staticmethod
    def wait_until(check, timeout: float, what: str) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if check():
                return time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(what)

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGCONT)
                    process.terminate()
                except ProcessLookupError:
                    pass
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.etcd is not None:
            self.etcd.stop()
