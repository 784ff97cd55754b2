"""A request larger than a member's KV pool is refused typed, on gRPC and on HTTP, by
the decode (prompt plus max_tokens) and by the prefill (the prompt), and the mesh keeps
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
async def test_a_request_larger_than_the_pool_is_resource_exhausted(
    small_pools, prompt_words, max_tokens, member
):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await tokens(small_pools, words(prompt_words), max_tokens)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pool exhausted" in e.value.details()
    async with httpx.AsyncClient(base_url=small_pools.base_url, timeout=60) as http:
        reply = await http.post("/completions", json={
            "model": "tiny", "prompt": words(prompt_words), "max_tokens": max_tokens,
            "ignore_eos": True,
        })
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["type"] == "rate_limit_exceeded"
    await anyio.to_thread.run_sync(wait_quiet, small_pools, 2.0)
    assert await tokens(small_pools, words(20), 8) == 8  # and the mesh still serves
