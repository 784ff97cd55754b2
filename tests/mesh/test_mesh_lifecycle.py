"""`pdmesh up` leaves no process behind: on SIGTERM, and when whoever started it dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdmesh.localmesh import start_mesh


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)],
                               capture_output=True, text=True).stdout.strip()
        if state and not state.startswith("Z"):
            out.append(pid)
    return out


def test_sigterm_stops_every_service(tmp_path):
    mesh = start_mesh(tmp_path, model="tiny")
    children = mesh.children()
    assert len(children) == 4  # bootstrap, prefill, decode, router
    mesh.stop()
    assert mesh.process.returncode == 0
    deadline = time.monotonic() + 5
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(children)
    assert "all services stopped" in mesh.log()
    assert "stopped with exit code" not in mesh.log()  # every member ended cleanly


def test_a_dead_parent_takes_the_mesh_with_it(tmp_path):
    """Also: starting the mesh never runs Python's fork hooks, i.e. never takes the plain
    fork() path (a `preexec_fn`). A plain fork of a process whose gRPC threads are live
    can abort the child in gRPC's fork handlers ('epoll_wait error: Bad file descriptor',
    `pdmesh up` dead before exec; docs/incidents.md); the child arms its own death
    signal after exec."""
    code = (
        "import os, pathlib, sys, time\n"
        "from pdmesh.localmesh import start_mesh\n"
        "forks = []\n"
        "os.register_at_fork(before=lambda: forks.append(1))\n"
        f"m = start_mesh(pathlib.Path({str(tmp_path)!r}), model='tiny')\n"
        "print(len(forks), m.process.pid, *m.children(), flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    forks, *pids = [int(p) for p in parent.stdout.readline().split()]
    assert forks == 0
    assert len(pids) == 5
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids)
