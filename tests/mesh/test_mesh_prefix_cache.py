"""Prefix caching on a real mesh: multi-turn conversations that resend their history.

Two tiny meshes, one with ``--prefix-cache on`` and one with ``off``, get the same
conversations. Greedy tokens are identical turn by turn; with caching on, later turns
compute fewer prompt tokens on the prefill, move fewer KV bytes (the decode names the
pages it holds), the trace says so, and the mesh still settles to inflight 0 and
kv_pages_used 0, with the cached pages reported apart.
"""

from __future__ import annotations

import anyio
import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh, wait_quiet

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
    # Quiescent, and what the caches keep is reported apart from kv_pages_used.
    for m in (p_on, d_on):
        assert m["kv_pages_used"] == 0 and m["kv_pages_cached"] > 0
        assert 0 < m["prefix_cache_hit_rate"] < 1
