"""The mesh under test, four processes (bootstrap, prefill, decode, router) started one
by one as an operator spreading them over hosts would, and the faults on their links:
in network namespaces (NetnsWorld) or behind loopback fault proxies (ProxyWorld)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.netfaults.namespaces import DEVICE, Topology
from bench.netfaults.proxy import Proxies
from pdmesh.certs import role_env, write_set
from pdmesh.localmesh import free_ports

SERVICES = ("bootstrap", "prefill", "decode", "router")
MEMBER_PORTS = {"prefill": 50060, "decode": 50070}
BOOTSTRAP_PORT, GRPC_PORT, HTTP_PORT = 50050, 50051, 8000


class World:
    """Starts, restarts and stops the services; subclasses say where they run and how a
    link fails."""

    kind = ""
    link_note = ""
    unsupported: dict[str, str] = {}  # fault kind -> why this world cannot make it

    def __init__(self, workdir: Path, lease: float, request_timeout: float) -> None:
        self.workdir = workdir
        self.lease = lease
        self.request_timeout = request_timeout
        self.processes: dict[str, subprocess.Popen] = {}
        self.certs = write_set(workdir / "certs", self.cert_hosts())

    # where things are
    def cert_hosts(self) -> list[str]:
        raise NotImplementedError

    def command(self, role: str) -> list[str]:
        raise NotImplementedError

    @property
    def router(self) -> str:
        raise NotImplementedError

    @property
    def bootstrap(self) -> str:
        raise NotImplementedError

    def _cli(self, role: str, *flags: str) -> list[str]:
        # every request moves its KV (no prefix cache hit skips the transfer)
        # a room without progress for longer than the lease and a second is reported pinned
        # (a frozen peer's rooms must have failed by then)
        model = {"bootstrap": [], "router": ["--model", "tiny"]}.get(
            role, ["--model", "tiny", "--prefix-cache", "off",
                   "--pinned-after", str(self.lease + 1.0)])
        if role == "prefill":  # each prompt's KV in 16-token writes 0.2 s apart: a fault at
            # any moment of the storm finds transfers half done
            model += ["--chunk-tokens", "16", "--faults", "pause_between_chunks=0.2"]
        return [sys.executable, "-m", "pdmesh.cli", role, *model, *flags]

    # processes
    def start(self, role: str) -> None:
        env = {**os.environ, **role_env(self.certs, role), "PYTHONUNBUFFERED": "1",
               "PDMESH_PARENT_PID": str(os.getpid()), "OMP_NUM_THREADS": "1"}
        log = (self.workdir / f"{role}.log").open("a")
        self.processes[role] = subprocess.Popen(self.command(role), env=env, stdout=log,
                                                stderr=subprocess.STDOUT)

    def start_all(self) -> None:
        for role in SERVICES:
            self.start(role)

    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.processes.items()}

    def alive(self, role: str) -> bool:
        return self.processes[role].poll() is None

    def signal(self, role: str, sig: int) -> None:
        self.processes[role].send_signal(sig)

    def kill_and_restart(self, role: str) -> None:
        self.signal(role, signal.SIGKILL)
        self.processes[role].wait(10)
        self.start(role)

    def stop(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.processes.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    # links: apply(fault, target) then clear(fault, target); None from apply: unsupported
    def apply(self, fault: str, target: str) -> str | None:
        raise NotImplementedError

    def clear(self, fault: str, target: str) -> None:
        raise NotImplementedError


class NetnsWorld(World):
    """One namespace per service on a bridge; NIXL over UCX's TCP transport on eth0."""

    kind = "netns"
    link_note = "every hop crosses the veth link, NIXL included (UCX_TLS=tcp)"

    def __init__(self, topology: Topology, workdir: Path, lease: float,
                 request_timeout: float, unsupported: dict[str, str]) -> None:
        self.topology = topology
        self.unsupported = unsupported
        super().__init__(workdir, lease, request_timeout)

    def cert_hosts(self) -> list[str]:
        return [self.topology.ip(r) for r in SERVICES]

    @property
    def router(self) -> str:
        return f"{self.topology.ip('router')}:{GRPC_PORT}"

    @property
    def bootstrap(self) -> str:
        return f"{self.topology.ip('bootstrap')}:{BOOTSTRAP_PORT}"

    def command(self, role: str) -> list[str]:
        ip = self.topology.ip(role)
        prefix = self.topology.exec_prefix(role)
        if role == "bootstrap":
            return prefix + self._cli(role, "--host", ip, "--port", str(BOOTSTRAP_PORT),
                                      "--lease", str(self.lease))
        if role == "router":
            return prefix + self._cli(role, "--name", "router", "--host", ip, "--grpc-port",
                                      str(GRPC_PORT), "--http-port", str(HTTP_PORT),
                                      "--bootstrap", self.bootstrap, "--request-timeout",
                                      str(self.request_timeout))
        return prefix + self._cli(role, "--name", f"{role}-0", "--host", ip, "--port",
                                  str(MEMBER_PORTS[role]), "--bootstrap", self.bootstrap,
                                  "--ucx-transports", "tcp", "--ucx-net-devices", DEVICE)

    def apply(self, fault: str, target: str) -> str | None:
        t = self.topology
        if fault in self.unsupported:
            return None
        if fault == "cut":
            t.cut(target)
        elif fault == "loss":
            t.loss(target, 20)
        elif fault == "delay":
            t.delay(target, 100)
        elif fault == "partition":
            t.partition(target, "bootstrap")
        return fault

    def clear(self, fault: str, target: str) -> None:
        t = self.topology
        if fault == "cut":
            t.uncut(target)
        elif fault in ("loss", "partition"):
            t.clear_filter(target)
        elif fault == "delay":
            t.undelay(target)


class ProxyWorld(World):
    """Every service on loopback; each member advertises its own proxy (127.0.1.K) and
    reaches the bootstrap through another (127.0.2.K). NIXL runs directly (UCX's choice)."""

    kind = "proxy"
    link_note = "gRPC hops cross a loopback TCP fault proxy; NIXL does not"

    def __init__(self, workdir: Path, lease: float, request_timeout: float) -> None:
        ports = free_ports(4)
        self.port = dict(zip(SERVICES, ports, strict=True))
        super().__init__(workdir, lease, request_timeout)
        self.proxies = Proxies()
        for k, role in enumerate(SERVICES[1:], start=1):
            self.proxies.add(f"in-{role}", (f"127.0.1.{k}", self.port[role]),
                             ("127.0.0.1", self.port[role]))
            self.proxies.add(f"boot-{role}", (f"127.0.2.{k}", self.port["bootstrap"]),
                             ("127.0.0.1", self.port["bootstrap"]))

    def cert_hosts(self) -> list[str]:
        return [f"127.0.{n}.{k}" for n in (1, 2) for k in range(1, len(SERVICES))]

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.port['router']}"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port['bootstrap']}"

    def command(self, role: str) -> list[str]:
        if role == "bootstrap":
            return self._cli(role, "--port", str(self.port[role]), "--lease", str(self.lease))
        k = SERVICES.index(role)
        common = ["--host", "127.0.0.1", "--advertise-address", f"127.0.1.{k}",
                  "--bootstrap", f"127.0.2.{k}:{self.port['bootstrap']}"]
        if role == "router":
            return self._cli(role, "--name", "router", *common, "--grpc-port",
                             str(self.port[role]), "--http-port", str(free_ports(1)[0]),
                             "--request-timeout", str(self.request_timeout))
        return self._cli(role, "--name", f"{role}-0", *common, "--port", str(self.port[role]))

    def apply(self, fault: str, target: str) -> str | None:
        links = [f"in-{target}", f"boot-{target}"]
        if fault == "cut":
            self.proxies.set(links, "cut")
        elif fault == "loss":
            self.proxies.set(links, "loss", loss=0.2)
        elif fault == "delay":
            self.proxies.set(links, "delay", delay=0.1)
        elif fault == "partition":
            self.proxies.set([f"boot-{target}"], "partition")
        return fault

    def clear(self, fault: str, target: str) -> None:
        self.proxies.set([f"in-{target}", f"boot-{target}"], "pass")

    def stop(self) -> None:
        super().stop()
        self.proxies.close()
