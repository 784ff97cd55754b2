"""KV-aware routing on `pdmesh up --prefill 2 --decode 2`: a conversation's turns land on
the pair that holds its KV while the members' load stays balanced, and the router's view
of the members' caches converges after a router restart and after a member restart.

Landing is measured twice: by the router (pdmesh_kv_routes_total by outcome) and by the
members themselves: every turn after the first resends the previous turn's prompt, so a
turn that lands finds at least that prompt's full pages (but the last, where tokenizing
the longer text may differ) in its prefill's and its decode's cache; the hits the members
count must reach 90% of that floor.
"""

from __future__ import annotations

import os
import re
import signal
import time

import anyio
import httpx
import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh, wait_quiet

CONVERSATIONS = 8
TURNS = 4
PAGE = 16


@pytest.fixture(scope="module")
def mesh_2x2(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("kvroute"), model="tiny", prefill=2, decode=2)
    yield mesh
    mesh.stop()


def router_metric(mesh, name: str, label: str) -> dict[str, float]:
    """``name``'s samples on the router's /metrics, by their ``label``'s value."""
    text = httpx.get(f"http://127.0.0.1:{mesh.http_port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            [value] = re.findall(label + r'="([^"]*)"', line)
            out[value] = float(line.rsplit(" ", 1)[1])
    return out


def members(status: dict) -> dict[str, dict]:
    return {m["name"]: m for m in status["members"] if m["role"] in ("prefill", "decode")}


async def conversation(mesh, c: int, prompt_tokens: list[int]) -> None:
    history = f"Conversation {c} begins. " + " ".join(
        f"the keeper {c} of lighthouse number {c * 7 + i} logs the weather" for i in range(16))
    async with GenerateClient(mesh.router) as client:
        for t in range(TURNS):
            history += f" user: question {t} of conversation {c}, about the tide " * 3
            text = ""
            async for item in client.generate(prompt=history, max_tokens=12, temperature=0,
                                              ignore_eos=True):
                if isinstance(item, Done):
                    prompt_tokens.append(item.prompt_tokens)
                else:
                    text += item.text
            history += " assistant:" + text


async def test_turns_land_where_their_kv_is_and_load_stays_balanced(mesh_2x2):
    mesh = mesh_2x2
    before = members(await anyio.to_thread.run_sync(wait_quiet, mesh, 5.0))
    routes0 = router_metric(mesh, "pdmesh_kv_routes_total", "outcome")
    prompts: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    async with anyio.create_task_group() as tg:
        for c in range(CONVERSATIONS):
            tg.start_soon(conversation, mesh, c, prompts[c])
    after = members(await anyio.to_thread.run_sync(wait_quiet, mesh, 10.0))
    routes1 = router_metric(mesh, "pdmesh_kv_routes_total", "outcome")
    routes = {k: routes1.get(k, 0) - routes0.get(k, 0) for k in ("cold", "landed", "elsewhere")}
    assert all(len(p) == TURNS for p in prompts), prompts
    later = CONVERSATIONS * (TURNS - 1)
    # the router's count: first turns are cold, later ones land
    assert routes["cold"] <= CONVERSATIONS, routes
    assert routes["landed"] >= 0.9 * later, routes
    # the members' count: hits reach 90% of what landing every later turn guarantees
    floor = sum(max(p[t - 1] // PAGE - 1, 0) * PAGE for p in prompts for t in range(1, TURNS))

    def delta(role: str, key: str) -> dict[str, int]:
        return {n: after[n][key] - before[n][key] for n in after if after[n]["role"] == role}

    for role in ("prefill", "decode"):
        hits = delta(role, "prefix_cache_hits_total")
        assert sum(hits.values()) >= 0.9 * floor, (role, hits, floor)
        served = delta(role, "requests_total")
        assert sum(served.values()) == CONVERSATIONS * TURNS
        assert max(served.values()) <= 1.5 * min(served.values()), (role, served)
    print(f"\nkv routing 2x2: {routes}, landed {routes['landed'] / later:.0%} of later turns; "
          f"requests {delta('prefill', 'requests_total')} {delta('decode', 'requests_total')}; "
          f"hits prefill {sum(delta('prefill', 'prefix_cache_hits_total').values())} "
          f"decode {sum(delta('decode', 'prefix_cache_hits_total').values())} of floor {floor}")


async def wait_converged(mesh, timeout: float = 30.0) -> dict[str, float]:
    """Until the router's view of every member (all four registered) equals the member's
    cached pages."""
    deadline = time.monotonic() + timeout
    while True:
        status = members(await anyio.to_thread.run_sync(wait_quiet, mesh, 10.0))
        try:
            view = await anyio.to_thread.run_sync(router_metric, mesh,
                                                  "pdmesh_kv_view_pages", "member")
        except httpx.HTTPError:
            view = {}
        cached = {n: m["kv_pages_cached"] for n, m in status.items()}  # None: not answering
        if len(cached) == 4 and view == cached:
            return view
        assert time.monotonic() < deadline, (view, cached)
        await anyio.sleep(0.3)


async def test_the_view_converges_after_router_and_member_restarts(mesh_2x2):
    mesh = mesh_2x2
    status = members(await anyio.to_thread.run_sync(mesh.status))
    if not any(m["kv_pages_cached"] for m in status.values()):
        await conversation(mesh, 99, [])
    view = await wait_converged(mesh)
    assert sum(view.values()) > 0
    # the router restarts: its view starts empty and converges from the snapshots
    old = mesh.pid_of("router")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if mesh.pid_of("router") != old:
                break
        except LookupError:
            pass
        assert time.monotonic() < deadline
        await anyio.sleep(0.3)
    assert await wait_converged(mesh, 60.0) == view
    # a member restarts with an empty cache: the router forgets what its old epoch held
    status = members(await anyio.to_thread.run_sync(mesh.status))
    victim = max((n for n in status if status[n]["role"] == "decode"),
                 key=lambda n: status[n]["kv_pages_cached"])
    os.kill(status[victim]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        now = members(await anyio.to_thread.run_sync(mesh.status))
        if victim in now and now[victim]["pid"] != status[victim]["pid"]:
            break
        assert time.monotonic() < deadline
        await anyio.sleep(0.3)
    after = await wait_converged(mesh, 60.0)
    assert after[victim] == 0
    # and the next turns still land (their prefill kept the KV) and are served
    routes0 = router_metric(mesh, "pdmesh_kv_routes_total", "outcome")
    await conversation(mesh, 100, [])
    routes1 = router_metric(mesh, "pdmesh_kv_routes_total", "outcome")
    assert routes1.get("landed", 0) - routes0.get("landed", 0) == TURNS - 1
