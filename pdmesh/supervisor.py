"""`pdmesh up`: start bootstrap, prefills, decodes and a router as child processes.

A crashed child is restarted with exponential backoff (and the log says so);
a child that exits EXIT_CANNOT_START (a flag's value cannot work on this
machine: restarting would fail the same way) stops the whole mesh, and
`pdmesh up` exits with that code. On Ctrl-C or SIGTERM every child gets
SIGTERM, then SIGKILL after a grace period, so no process is left behind.
Children also ask the kernel to SIGTERM them if the supervisor itself dies
(see pdmesh.cli).

Prefills and decodes run on --device, or on --prefill-device / --decode-device
(prefill on one GPU, decode on another). The members on one GPU share it: each is
given an equal share of that GPU's --gpu-memory-fraction and sizes its KV pool from
that, so a prefill alone on cuda:0 may fill the whole fraction of cuda:0.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import Process

from libs.member import sizing
from libs.member.serve import EXIT_CANNOT_START
from libs.rpc.addresses import WILDCARDS

log = logging.getLogger("pdmesh.up")

STOP_GRACE = 8.0


class ChildCannotStart(Exception):
    """A child exited EXIT_CANNOT_START: the mesh cannot run as configured."""


@dataclass
class Child:
    name: str
    argv: list[str]
    role: str = ""
    restarts: int = 0
    process: Process | None = None
    started_at: float = 0.0


@dataclass
class Plan:
    model: str = "smollm2"
    device: str = "cpu"
    prefill_device: str | None = None  # default: device
    decode_device: str | None = None  # default: device
    dtype: str = "float32"
    weights: str = "native"
    kv_transfer: str = "native"
    prefix_cache: str = "on"
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    bootstrap_port: int = 50050
    gpu_memory_fraction: float = sizing.DEFAULT_GPU_MEMORY_FRACTION  # of the GPU, all members
    extra: dict[str, list[str]] = field(default_factory=dict)
    certs: Path | None = None  # a `pdmesh certs` set: each child gets its role's certificate
    advertise_address: str | None = None  # what the children register (default: --host)

    @property
    def advertised(self) -> str:
        """What every child registers and dials: --advertise-address, else --host, else
        (a wildcard bind: every child is on this host) 127.0.0.1."""
        if self.advertise_address:
            return self.advertise_address
        return "127.0.0.1" if self.host in WILDCARDS else self.host

    @property
    def bootstrap(self) -> str:
        return f"{self.advertised}:{self.bootstrap_port}"

    def device_of(self, role: str) -> str:
        """The device the prefills (role "prefill") or the decodes run on."""
        own = self.prefill_device if role == "prefill" else self.decode_device
        return own or self.device

    def memory_fraction_of(self, role: str) -> float:
        """A prefill's or decode's share of its GPU: the fraction split evenly between
        every member on that GPU ("cuda" and "cuda:0" being one)."""
        gpu = sizing.cuda_index(self.device_of(role))
        sharing = sum(count for other, count in (("prefill", self.prefill),
                                                  ("decode", self.decode))
                      if sizing.cuda_index(self.device_of(other)) == gpu)
        return self.gpu_memory_fraction / sharing

    def describe_devices(self) -> str:
        """'on cuda' or 'prefill on cuda:0, decode on cuda:1', with each GPU member's share."""
        def one(role: str) -> str:
            device = self.device_of(role)
            share = (f" ({self.memory_fraction_of(role):.3g} of its memory each)"
                     if sizing.is_cuda(device) else "")
            return f"{device}{share}"

        if self.device_of("prefill") == self.device_of("decode"):
            return f"on {one('prefill')}"
        return f"prefill on {one('prefill')}, decode on {one('decode')}"

    def children(self) -> list[Child]:
        base = [sys.executable, "-m", "pdmesh.cli"]
        common = ["--bootstrap", self.bootstrap, "--host", self.host]
        if self.advertised != self.host:
            common += ["--advertise-address", self.advertised]
        def member(role: str) -> list[str]:
            device = self.device_of(role)
            argv = [*common, "--model", self.model, "--device", device, "--dtype", self.dtype,
                    "--weights", self.weights, "--kv-transfer", self.kv_transfer,
                    "--prefix-cache", self.prefix_cache]
            if sizing.is_cuda(device):
                argv += ["--gpu-memory-fraction", f"{self.memory_fraction_of(role):.6g}"]
            return argv

        out = [Child("bootstrap", [*base, "bootstrap", *common[2:],
                                   "--port", str(self.bootstrap_port)], "bootstrap")]
        for role, count in (("prefill", self.prefill), ("decode", self.decode)):
            for i in range(count):
                out.append(Child(f"{role}-{i}", [*base, role, "--name", f"{role}-{i}",
                                                 *member(role), *self.extra.get(role, [])],
                                 role))
        out.append(Child("router", [*base, "router", "--name", "router", *common,
                                    "--model", self.model,
                                    "--http-port", str(self.http_port),
                                    "--grpc-port", str(self.grpc_port),
                                    *self.extra.get("router", [])], "router"))
        return out

    def child_env(self, child: Child, env: dict[str, str]) -> dict[str, str]:
        """`env` with the child's own role certificate when the mesh runs TLS."""
        if self.certs is None:
            return env
        from pdmesh.certs import role_env

        return {**env, **role_env(self.certs, child.role)}


async def supervise(plan: Plan) -> None:
    env = {**os.environ, "PDMESH_PARENT_PID": str(os.getpid())}
    children = plan.children()
    log.info("starting %d prefill, %d decode, model %s %s", plan.prefill, plan.decode,
             plan.model, plan.describe_devices())
    try:
        async with anyio.create_task_group() as tg:
            for child in children:
                tg.start_soon(_keep_running, child, plan.child_env(child, env))
                if child.name == "bootstrap":
                    await anyio.sleep(0.3)  # members retry anyway; this just spares log noise
            tg.start_soon(_announce_ready, plan)
    except* ChildCannotStart:
        # Raised here, not in the child's task: a SystemExit leaving an asyncio task
        # escapes the event loop at once, past every finally block.
        raise SystemExit(EXIT_CANNOT_START) from None
    finally:
        with anyio.move_on_after(STOP_GRACE + 2, shield=True):
            await _stop_all(children)


async def _keep_running(child: Child, env: dict[str, str]) -> None:
    backoff = 0.5
    while True:
        child.started_at = time.monotonic()
        child.process = await anyio.open_process(
            child.argv, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env
        )
        code = await child.process.wait()
        lived = time.monotonic() - child.started_at
        if code == EXIT_CANNOT_START:
            log.error("%s cannot start here (exit code %d, its reason above): stopping the mesh",
                      child.name, code)
            raise ChildCannotStart(child.name)
        if lived > 30:
            backoff = 0.5
        child.restarts += 1
        log.warning(
            "%s exited with code %s after %.1fs; restart #%d in %.1fs",
            child.name, code, lived, child.restarts, backoff,
        )
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, 10.0)


async def _stop_all(children: list[Child]) -> None:
    running = [c for c in children if c.process and c.process.returncode is None]
    live = [c.process for c in running]
    for process in reversed(live):  # router first, bootstrap last
        _signal(process, signal.SIGTERM)
    with anyio.move_on_after(STOP_GRACE):
        for process in live:
            await process.wait()
    for process in live:
        if process.returncode is None:
            log.warning("pid %d ignored SIGTERM; killing it", process.pid)
            _signal(process, signal.SIGKILL)
            await process.wait()
    for child in running:  # a stop that did not end cleanly is worth a line (a child that
        code = child.process.returncode  # died earlier was logged when it did)
        if code not in (0, -signal.SIGTERM):
            log.warning("%s stopped with exit code %s", child.name, code)
    log.info("all services stopped")


def _signal(process: Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass


async def _announce_ready(plan: Plan) -> None:
    url = f"http://{plan.advertised}:{plan.http_port}/health"
    started = time.monotonic()
    while True:
        if await anyio.to_thread.run_sync(_healthy, url):
            log.info(
                "mesh ready in %.1fs: OpenAI API at http://%s:%d/v1, gRPC Generate at %s:%d",
                time.monotonic() - started, plan.host, plan.http_port, plan.host, plan.grpc_port,
            )
            return
        await anyio.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
