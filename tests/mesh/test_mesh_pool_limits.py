"""A request larger than a member's whole KV pool is refused typed and at once (waiting
in the router's queue would not help), on gRPC (OUT_OF_RANGE) and on HTTP (400), by the
decode (prompt plus max_tokens) and by the prefill (the prompt), and the mesh keeps
serving with nothing held."""

from __future__ import annotations

import anyio
import grpc
import httpx
import pytest

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet

WORDS = "river engine harbour lantern meadow copper signal orchard thunder violet".split()


def words(n: int) -> str:
    """n words, one tiny-model token each."""
    return " ".join(WORDS[i * 7 % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def small_pools(tmp_path_factory):
    # The prefill holds 128 tokens of KV, the decode 512.
    mesh = start_mesh(tmp_path_factory.mktemp("pools"), model="tiny",
                      up_args=["--prefill-kv-pages", "8", "--decode-kv-pages", "32"])
    yield mesh
    mesh.stop()


async def tokens(mesh, prompt: str, max_tokens: int) -> int:
    n = 0
    async with GenerateClient(mesh.router, timeout=60) as client:
        async for item in client.generate(prompt=prompt, max_tokens=max_tokens, ignore_eos=True):
            if isinstance(item, Piece):
                n += len(item.token_ids)
    return n


@pytest.mark.parametrize("prompt_words, max_tokens, member", [
    (50, 600, "decode"),  # 650 tokens: 41 pages of the decode's 32
    (200, 8, "prefill"),  # a 200-token prompt: 13 pages of the prefill's 8
])
async def test_a_request_larger_than_the_pool_is_refused_at_once(
    small_pools, prompt_words, max_tokens, member
):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await tokens(small_pools, words(prompt_words), max_tokens)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "more than the whole pool" in e.value.details()
    async with httpx.AsyncClient(base_url=small_pools.base_url, timeout=60) as http:
        reply = await http.post("/completions", json={
            "model": "tiny", "prompt": words(prompt_words), "max_tokens": max_tokens,
            "ignore_eos": True,
        })
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "kv_pool_exceeded"
    await anyio.to_thread.run_sync(wait_quiet, small_pools, 2.0)
    assert await tokens(small_pools, words(20), 8) == 8  # and the mesh still serves
