"""Admission that waits, on a real mesh: a decode pool that holds one request at a time
makes the others wait in the router's queue, and they all complete; a full queue
answers 429 with Retry-After (HTTP) and RESOURCE_EXHAUSTED with retry-after metadata
(gRPC) at once; a client that leaves while queued leaves a clean queue, a quiescent mesh
and a trace that says stage=queued."""

from __future__ import annotations

import time
import urllib.request

import anyio
import grpc
import httpx
import pytest

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet
from tests.mesh.otlp import ERROR, roots_since, serve_receiver

PROMPT = "river engine harbour lantern " * 5  # 20 words, one tiny-model token each
MAX_TOKENS = 100  # prompt + max_tokens: 8 pages of 16 tokens; the decode holds 10
MAX_QUEUE = 3


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory):
    # The prefill holds each final write 0.5 s, so a request keeps the decode's pages
    # for at least that long: the others must wait their turn. Up-front reservation, so
    # that the decode admits one request at a time rather than preempting (that is
    # test_mesh_preemption's).
    receiver, server, env = serve_receiver()
    mesh = start_mesh(tmp_path_factory.mktemp("queue"), model="tiny", extra_env=env,
                      up_args=["--decode-kv-pages", "10", "--faults", "delay_kv_ready=0.5",
                               "--decode-args", "--kv-reserve upfront",
                               "--router-args", f"--max-queue {MAX_QUEUE}"])
    yield mesh, receiver
    mesh.stop()
    server.stop(0)


def router_row(mesh) -> dict:
    return next(m for m in mesh.status()["members"] if m["role"] == "router")


def queue_metrics(mesh) -> dict[str, float]:
    url = router_row(mesh)["metrics"]
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("pdmesh_queue_time_seconds_count", "pdmesh_queue_time_seconds_sum",
                     "pdmesh_queue_depth"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def generate(mesh, max_tokens: int = MAX_TOKENS) -> int:
    n = 0
    async with GenerateClient(mesh.router, timeout=60) as client:
        async for item in client.generate(prompt=PROMPT, max_tokens=max_tokens,
                                          ignore_eos=True):
            if isinstance(item, Piece):
                n += len(item.token_ids)
    return n


async def wait_for_depth(mesh, depth: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := (await anyio.to_thread.run_sync(router_row, mesh))["queue_depth"]) != depth:
        assert time.monotonic() < deadline, f"queue depth {seen}, never {depth}"
        await anyio.sleep(0.02)


async def test_a_small_pool_makes_requests_wait_and_every_one_completes(one_at_a_time):
    mesh, _ = one_at_a_time
    before = await anyio.to_thread.run_sync(queue_metrics, mesh)
    served: list[int] = []
    depths: list[int] = []

    async def one() -> None:
        served.append(await generate(mesh))

    async with anyio.create_task_group() as tg:
        for _ in range(MAX_QUEUE + 1):
            tg.start_soon(one)
        while len(served) < MAX_QUEUE + 1:
            depths.append((await anyio.to_thread.run_sync(router_row, mesh))["queue_depth"])
            await anyio.sleep(0.05)
    assert served == [MAX_TOKENS] * (MAX_QUEUE + 1)
    assert max(depths) >= 2, depths  # they did wait, in the router's queue
    after = await anyio.to_thread.run_sync(queue_metrics, mesh)
    count = "pdmesh_queue_time_seconds_count"
    assert after[count] - before[count] == MAX_QUEUE + 1
    # three waited behind one another, each behind at least one 0.5 s hold
    waited = after["pdmesh_queue_time_seconds_sum"] - before["pdmesh_queue_time_seconds_sum"]
    assert waited >= 1.0, waited
    assert after["pdmesh_queue_depth"] == 0
    status = await anyio.to_thread.run_sync(wait_quiet, mesh, 1.0)
    assert all(not m["pinned"] for m in status["members"])


async def test_a_full_queue_answers_429_with_retry_after_at_once(one_at_a_time):
    mesh, _ = one_at_a_time
    served: list[int] = []

    async def one() -> None:
        served.append(await generate(mesh))

    async with anyio.create_task_group() as tg:
        for _ in range(MAX_QUEUE + 1):  # one runs, MAX_QUEUE wait
            tg.start_soon(one)
        await wait_for_depth(mesh, MAX_QUEUE)
        async with httpx.AsyncClient(base_url=mesh.base_url, timeout=30) as http:
            t0 = time.monotonic()
            reply = await http.post("/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 8})
            refused_in = time.monotonic() - t0
        assert reply.status_code == 429, reply.text
        assert reply.headers["retry-after"] == "1"
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and "queue is full" in error["message"]
        assert refused_in < 0.5  # at once, not after a wait
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(mesh, 8)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after", "1") in tuple(e.value.trailing_metadata() or ())
    assert served == [MAX_TOKENS] * (MAX_QUEUE + 1)  # the queued ones were not disturbed
    await anyio.to_thread.run_sync(wait_quiet, mesh, 1.0)


async def test_a_client_that_leaves_while_queued_leaves_nothing_and_is_traced_queued(
        one_at_a_time):
    mesh, receiver = one_at_a_time
    before = len(roots_since(receiver, 0, 0))
    served: list[int] = []

    async def first() -> None:
        served.append(await generate(mesh))

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await wait_for_depth(mesh, 0)
        await anyio.sleep(0.1)  # the first holds the pages now
        leaving = anyio.CancelScope()

        async def second() -> None:
            with leaving:
                await generate(mesh)

        tg.start_soon(second)
        await wait_for_depth(mesh, 1)
        await anyio.sleep(0.3)  # its tries are 80 ms apart or more by now: it leaves between
        left_at = time.monotonic()
        leaving.cancel()
        await wait_for_depth(mesh, 0, timeout=1.0)
        assert time.monotonic() - left_at < 1.0
    assert served == [MAX_TOKENS]
    status = await anyio.to_thread.run_sync(wait_quiet, mesh, 1.0)
    assert all(not m["pinned"] for m in status["members"])
    roots = roots_since(receiver, 0, before + 2)
    # only this test's client leaves (the other tests' refusals end as `rejected`)
    (left,) = [r for r in roots if r["status"] == ERROR
               and r["attributes"].get("pdmesh.abort.reason") == "client_disconnect"]
    assert left["attributes"]["pdmesh.abort.stage"] == "queued"
    time.sleep(0.5)  # the rest of its trace's spans
    with receiver.lock:
        spans = [s for s in receiver.spans if s["trace"] == left["trace"]]
    names = {(s["service"], s["name"]) for s in spans}
    (wait,) = [s for s in spans if s["name"] == "queue wait"]  # one for its whole stay
    assert wait["status"] == ERROR and wait["attributes"]["pdmesh.abort.stage"] == "queued"
    if "cancelled" in wait["events"]:  # it left between tries (not during one, which
        # is aborted as any request whose decode call is open): no Abort anywhere
        assert ("pdmesh-router", "abort") not in names, names
        assert not any(service == "pdmesh-prefill" for service, _ in names), names
