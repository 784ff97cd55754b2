"""An nvfp4 prefill and a native decode in one mesh: they never pair, and say why.

Refused at registration, not found as garbage KV or a hang (design invariant 9): the
router finds no compatible pair (UNAVAILABLE naming both formats, /health 503), and a
direct Prefill or Decode call that names the other member as its peer is refused with
FAILED_PRECONDITION naming both formats, before any state exists.
"""

from __future__ import annotations

import anyio
import grpc
import httpx
import pytest

from libs.rpc.calls import open_channel
from pdmesh.client import GenerateClient
from pdmesh.localmesh import start_mesh, wait_quiet
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc

BOTH = ("'nvfp4'", "'native'")


@pytest.fixture(scope="module")
def mixed_mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("mixedkv"), model="tiny",
                      up_args=["--prefill-args", "--kv-transfer nvfp4"], wait_healthy=False)
    yield mesh
    mesh.stop()


def _members(mesh) -> dict[str, dict]:
    return {m["role"]: m for m in mesh.status()["members"]}


async def test_router_never_pairs_them(mixed_mesh):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async with GenerateClient(mixed_mesh.router) as client:
            async for _ in client.generate(prompt="hello there", max_tokens=4):
                pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details()
    assert "no reachable prefill/decode pair" in details
    assert "transfer_format differs: prefill-0 'nvfp4', decode-0 'native'" in details
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"http://127.0.0.1:{mixed_mesh.http_port}/health")
    assert r.status_code == 503
    assert "transfer_format differs" in r.json()["reason"]
    await anyio.to_thread.run_sync(wait_quiet, mixed_mesh, 2.0)


async def test_direct_calls_naming_a_peer_of_another_format_are_refused(mixed_mesh):
    members = await anyio.to_thread.run_sync(_members, mixed_mesh)
    prefill, decode = members["prefill"], members["decode"]
    key = cpb.RoomKey(room=b"m" * 16, generation=1)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=4)
    channels = [open_channel(prefill["address"]), open_channel(decode["address"])]
    try:
        request = ppb.PrefillRequest(
            key=key, prompt_tokens=[1, 2, 3], sampling=sampling,
            transfer=cpb.TransferInfo(
                key=key, decode=cpb.PeerRef(name=decode["name"], epoch=decode["epoch"]),
                dst_pages=[0],
            ),
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in pgrpc.PrefillStub(channels[0]).Prefill(request, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "transfer_format differs" in info.value.details()
        assert all(f in info.value.details() for f in BOTH), info.value.details()

        generate = dpb.DecodeRequest(
            key=key, prompt_tokens=3, sampling=sampling,
            prefill=cpb.PeerRef(name=prefill["name"], epoch=prefill["epoch"]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in dgrpc.DecodeStub(channels[1]).Generate(generate, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert all(f in info.value.details() for f in BOTH), info.value.details()
    finally:
        for channel in channels:
            await channel.close()
    await anyio.to_thread.run_sync(wait_quiet, mixed_mesh, 2.0)  # nothing was created
