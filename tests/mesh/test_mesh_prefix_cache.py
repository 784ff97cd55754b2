"""Prefix caching on a real mesh: multi-turn conversations that resend their history.

Two tiny meshes, one with ``--prefix-cache on`` and one with ``off``, get the same
conversations. Greedy tokens are identical turn by turn; with caching on, later turns
compute fewer prompt tokens on the prefill, move fewer KV bytes (the decode names the
pages it holds), the trace says so, and the mesh still settles to inflight 0 and
kv_pages_used 0, with the cached pages reported apart.
"""

from __future__ import annotations

import os

import anyio
import grpc
import httpx
import pytest

from libs.rpc.calls import open_channel
from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh, wait_quiet
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc

TURNS = 3
QUESTIONS = ["tell me about the river and the old mill by the bridge " * 6,
             "now explain why the water turns the wheel so slowly in summer " * 3,
             "and what happens in winter when the river freezes over " * 3]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    on = start_mesh(tmp_path_factory.mktemp("cache-on"), model="tiny",
                    up_args=["--prefix-cache", "on"])
    try:
        off = start_mesh(tmp_path_factory.mktemp("cache-off"), model="tiny",
                         up_args=["--prefix-cache", "off"])
    except BaseException:
        on.stop()
        raise
    yield on, off
    off.stop()
    on.stop()


async def conversation(mesh, opening: str) -> list[list[int]]:
    """One conversation: each turn resends everything so far plus the next question."""
    history, turns = opening, []
    async with GenerateClient(mesh.router) as client:
        for question in QUESTIONS[:TURNS]:
            history += " user: " + question
            ids, text = [], ""
            async for item in client.generate(prompt=history, max_tokens=12, temperature=0,
                                              ignore_eos=True):
                if isinstance(item, Done):
                    assert item.finish_reason == "length"
                else:
                    ids += item.token_ids
                    text += item.text
            turns.append(ids)
            history += " assistant:" + text
    return turns


def member(status: dict, role: str) -> dict:
    return next(m for m in status["members"] if m["role"] == role)


async def test_greedy_tokens_identical_and_later_turns_cheaper(meshes):
    on, off = meshes
    openings = [f"conversation {i}: a story about a village" for i in range(3)]
    for opening in openings:
        assert await conversation(on, opening) == await conversation(off, opening)
    status_on = await anyio.to_thread.run_sync(wait_quiet, on, 5.0)
    status_off = await anyio.to_thread.run_sync(wait_quiet, off, 5.0)
    p_on, p_off = member(status_on, "prefill"), member(status_off, "prefill")
    d_on = member(status_on, "decode")
    # Turns 2 and 3 found most of their prompt cached on both sides.
    assert p_on["prompt_tokens_computed_total"] < 0.75 * p_off["prompt_tokens_computed_total"]
    assert p_on["kv_transfer_bytes_skipped_total"] > 0
    assert (p_on["kv_transfer_bytes_moved_total"]
            < 0.75 * p_off["kv_transfer_bytes_moved_total"])
    assert p_off["kv_transfer_bytes_skipped_total"] == 0
    assert p_off["prefix_cache_hits_total"] == 0 and p_off["kv_pages_cached"] == 0
    # caching off is a cache of 0 pages: the router's view stays empty, every turn is cold
    off_metrics = httpx.get(f"http://127.0.0.1:{off.http_port}/metrics", timeout=10).text
    routes = [line for line in off_metrics.splitlines()
              if line.startswith("pdmesh_kv_routes_total{")]
    assert routes and all('outcome="cold"' in line for line in routes), routes
    assert all(line.endswith(" 0.0") for line in off_metrics.splitlines()
               if line.startswith("pdmesh_kv_view_pages{")), off_metrics
    # Quiescent, and what the caches keep is reported apart from kv_pages_used.
    for m in (p_on, d_on):
        assert m["kv_pages_used"] == 0 and m["kv_pages_cached"] > 0
        assert 0 < m["prefix_cache_hit_rate"] < 1


def page_aligned_prompt(page: int = 16) -> tuple[str, list[int]]:
    """A raw prompt whose tokens (as the router encodes them) fill whole pages."""
    from libs.engine.specs import load_tokenizer

    _, tokenizer = load_tokenizer("tiny")
    for n in range(30, 80):
        text = "the keeper of the lighthouse writes down the tide " * (n // 8) + "wind " * (n % 8)
        ids = tokenizer.encode(text)
        if len(ids) % page == 0:
            return text, ids
    raise AssertionError("no page-aligned prompt")


async def greedy(mesh, prompt: str) -> list[int]:
    ids = []
    async with GenerateClient(mesh.router) as client:
        async for item in client.generate(prompt=prompt, max_tokens=6, temperature=0,
                                          ignore_eos=True):
            if not isinstance(item, Done):
                ids += item.token_ids
    return ids


async def test_a_turn_whose_whole_prompt_the_decode_holds_moves_no_kv(meshes):
    on, _ = meshes
    text, ids = await anyio.to_thread.run_sync(page_aligned_prompt)
    first = await greedy(on, text)
    before = member(await anyio.to_thread.run_sync(wait_quiet, on, 5.0), "prefill")
    assert await greedy(on, text) == first
    after = member(await anyio.to_thread.run_sync(wait_quiet, on, 5.0), "prefill")
    moved = after["kv_transfer_bytes_moved_total"] - before["kv_transfer_bytes_moved_total"]
    skipped = after["kv_transfer_bytes_skipped_total"] - before["kv_transfer_bytes_skipped_total"]
    assert moved == 0
    pages = len(ids) // 16
    assert skipped > 0 and skipped % pages == 0  # every page of the prompt, none moved


async def test_a_write_aimed_at_the_decodes_cached_pages_is_refused(meshes):
    """The decode names the pages it holds (held_pages) inside its signed grant: a
    TransferInfo changed to send the prefill into those shared pages is refused before
    any byte moves, and the cached KV serves the same tokens afterwards."""


    on, _ = meshes
    text, ids = await anyio.to_thread.run_sync(page_aligned_prompt)
    first = await greedy(on, text)
    status = await anyio.to_thread.run_sync(wait_quiet, on, 5.0)
    prefill, decode = member(status, "prefill"), member(status, "decode")
    key = cpb.RoomKey(room=os.urandom(16), generation=1)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=4)
    d_channel, p_channel = open_channel(decode["address"]), open_channel(prefill["address"])
    try:
        call = dgrpc.DecodeStub(d_channel).Generate(dpb.DecodeRequest(
            key=key, prompt_tokens=len(ids), prompt_token_ids=ids, sampling=sampling,
            prefill=cpb.PeerRef(name=prefill["name"], epoch=prefill["epoch"])), timeout=30)
        info = (await call.read()).transfer
        assert info.held_pages == len(ids) // 16  # the decode holds the prompt whole
        forged = cpb.TransferInfo()
        forged.CopyFrom(info)
        forged.held_pages = 0  # "write every page", the cached ones included
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in pgrpc.PrefillStub(p_channel).Prefill(ppb.PrefillRequest(
                    key=key, prompt_tokens=ids, sampling=sampling, transfer=forged),
                    timeout=30):
                pass
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        call.cancel()
    finally:
        await d_channel.close()
        await p_channel.close()
    after = member(await anyio.to_thread.run_sync(wait_quiet, on, 10.0), "prefill")
    assert after["kv_transfer_bytes_moved_total"] == prefill["kv_transfer_bytes_moved_total"]
    assert await greedy(on, text) == first  # the cached pages still hold the prompt's KV
