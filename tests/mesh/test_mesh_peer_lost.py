"""W5: a decode that hangs (SIGSTOP) mid-stream: its lease runs out, the router fails the
request at once with a typed error instead of waiting on a silent connection; once the
decode wakes, it re-registers under a new epoch and the mesh serves again."""

from __future__ import annotations

import os
import signal
import time

import anyio
import grpc
import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("peerlost"), model="tiny")
    yield mesh
    mesh.stop()




async def test_a_hung_decode_fails_its_requests_within_the_lease(mesh):
    decode_pid = mesh.pid_of("decode")
    got = 0
    stopped_at = None
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with GenerateClient(mesh.router, timeout=120) as client:
                async for _item in client.generate(prompt="hang " * 50, max_tokens=6000,
                                                   ignore_eos=True):
                    got += 1
                    if got == 5:
                        os.kill(decode_pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
        failed_after = time.monotonic() - stopped_at
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "left the mesh" in err.value.details()
    assert failed_after < 9.0, failed_after  # lease 5 s + sweep; keepalive alone takes ~30 s
    for _ in range(100):  # the woken decode re-registers under a new epoch
        try:
            async with GenerateClient(mesh.router) as client:
                items = [i async for i in client.generate(prompt="again", max_tokens=3)]
            assert isinstance(items[-1], Done)
            return
        except grpc.aio.AioRpcError:
            await anyio.sleep(0.2)
    raise AssertionError(mesh.log()[-3000:])
