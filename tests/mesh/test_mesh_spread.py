"""`pdmesh up --prefill 2 --decode 2`: requests spread over both pairs."""

from __future__ import annotations

import anyio
import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh, wait_quiet


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("spread"), model="tiny", prefill=2, decode=2)
    yield mesh
    mesh.stop()


async def test_requests_spread_over_both_pairs(mesh_2x2):
    done: list[Done] = []

    async def one(i: int) -> None:
        async with GenerateClient(mesh_2x2.router) as client:
            async for item in client.generate(prompt=f"request {i} " * 20, max_tokens=24):
                if isinstance(item, Done):
                    done.append(item)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert len(done) == 8
    status = await anyio.to_thread.run_sync(wait_quiet, mesh_2x2, 2.0)
    served = {m["name"]: m["requests_total"] for m in status["members"]
              if m["role"] in ("prefill", "decode")}
    assert sorted(served) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert all(count >= 2 for count in served.values()), served
