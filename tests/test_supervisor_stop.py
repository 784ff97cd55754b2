"""The supervisor's stop names every member that did not end cleanly."""

from __future__ import annotations

import logging
import sys

import anyio

from pdmesh.supervisor import Child, _stop_all

ON_TERM_EXIT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit({code}))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


async def _start(name: str, code: int) -> Child:
    child = Child(name, [sys.executable, "-c", ON_TERM_EXIT.format(code=code)])
    child.process = await anyio.open_process(child.argv)
    assert child.process.stdout is not None
    await child.process.stdout.receive()  # its handler is installed
    return child


async def test_stop_reports_members_that_exit_badly(caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdmesh.up")
    clean, crashing = await _start("decode-0", 0), await _start("prefill-0", 134)
    with anyio.fail_after(20):
        await _stop_all([clean, crashing])
    assert crashing.process.returncode == 134 and clean.process.returncode == 0
    lines = [r.getMessage() for r in caplog.records]
    assert "prefill-0 stopped with exit code 134" in lines
    assert not any(line.startswith("decode-0 stopped") for line in lines)
    assert lines[-1] == "all services stopped"


async def test_a_child_that_died_before_the_stop_is_not_blamed_for_it(caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdmesh.up")
    dead = await _start("decode-0", 0)
    dead.process.kill()  # died earlier (its exit was logged then); now in restart backoff
    await dead.process.wait()
    alive = await _start("prefill-0", 0)
    with anyio.fail_after(20):
        await _stop_all([dead, alive])
    assert not [r for r in caplog.records if "stopped with exit code" in r.getMessage()]
