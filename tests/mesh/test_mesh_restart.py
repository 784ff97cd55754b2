"""The supervisor restarts a SIGKILLed decode; the prefill drops the old agent and adds
the new epoch's; requests succeed again without restarting anything else."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("restart"), model="tiny")
    yield mesh
    mesh.stop()




def _member(status: dict, role: str) -> dict:
    return next(m for m in status["members"] if m["role"] == role)


async def _one(mesh) -> Done:
    async with GenerateClient(mesh.router) as client:
        items = [i async for i in client.generate(prompt="after the restart", max_tokens=4)]
    return items[-1]


async def test_decode_restart_alone_heals_the_mesh(mesh):
    import anyio

    before = await anyio.to_thread.run_sync(mesh.status)
    old_decode = _member(before, "decode")
    old_prefill = _member(before, "prefill")
    os.kill(mesh.pid_of("decode"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = await anyio.to_thread.run_sync(mesh.status)
        decodes = [m for m in status["members"] if m["role"] == "decode"]
        if decodes and decodes[0]["epoch"] != old_decode["epoch"] and decodes[0]["healthy"]:
            break
        await anyio.sleep(0.2)
    else:
        raise AssertionError(f"decode not back:\n{mesh.log()[-3000:]}")
    assert "restart #1" in mesh.log()
    assert _member(status, "prefill")["epoch"] == old_prefill["epoch"]  # never restarted
    done = None
    for _ in range(50):  # the router may need a moment to see the new epoch
        try:
            done = await _one(mesh)
            break
        except Exception:
            await anyio.sleep(0.2)
    assert isinstance(done, Done) and done.completion_tokens >= 1
    after = await anyio.to_thread.run_sync(mesh.status)
    assert _member(after, "prefill")["transfer_failed_total"] == 0
