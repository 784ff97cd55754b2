"""A mesh over a real etcd: two bootstrap replicas, two routers, one prefill, one decode
(the tiny model), every one its own process. In file order: a replica killed under load,
a member cut off until its lease ends, then the abort storm that kills a replica and a
router (last: it leaves them dead)."""

from __future__ import annotations

import re
import signal
import time
from datetime import datetime

import anyio
import grpc
import pytest

from pdmesh.client import Done, GenerateClient
from pdmesh.etcdmesh import EtcdMesh
from pdmesh.etcdstorm import storm
from pdmesh.status import collect

LEASE = 3.0
PEERS = ("prefill-0", "router-0", "router-1")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, etcd_installed):
    mesh = EtcdMesh(tmp_path_factory.mktemp("etcdmesh"), lease=LEASE)
    try:
        mesh.start()
    except Exception:
        mesh.stop()
        raise
    yield mesh
    mesh.stop()


async def generate(mesh: EtcdMesh, router: str, prompt: str, max_tokens: int = 8) -> Done:
    async with GenerateClient(f"127.0.0.1:{mesh.router_ports[router][1]}", timeout=30) as c:
        items = [i async for i in c.generate(prompt=prompt, max_tokens=max_tokens,
                                             temperature=0)]
    return items[-1]


async def test_a_bootstrap_replica_killed_under_load_changes_nothing(mesh):
    before = await mesh.listed()
    results: list[Done] = []

    async def worker(router: str, n: int) -> None:
        for i in range(n):
            results.append(await generate(mesh, router, f"load {router} {i}"))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(worker, f"router-{i % 2}", 5)
        await anyio.sleep(0.5)
        mesh.kill("bootstrap-0")  # SIGKILL: its watchers and keep-alives move to bootstrap-1
    assert len(results) == 20 and all(r.completion_tokens == 8 for r in results)
    await anyio.sleep(LEASE)  # long enough for any lost lease to have shown
    assert await mesh.listed(1) == before  # same members, same epochs: nobody re-registered
    status = await collect(mesh.bootstrap)  # `pdmesh status --bootstrap A,B`: A is dead
    assert {m["name"]: m["epoch"] for m in status["members"]} == before
    mesh.start_bootstrap(0)  # a fresh replica serves the same view at once
    await anyio.to_thread.run_sync(
        mesh.wait_until, lambda: mesh.members(0) == before, 20.0, "replica 0 back")


def _left_at(mesh: EtcdMesh, process: str, name: str, epoch: int) -> float | None:
    """Wall-clock time `process` logged that member `name` epoch `epoch` left."""
    pattern = re.compile(rf"^(\S+ \S+) .*member {name} epoch {epoch} left: (.*)$", re.M)
    match = pattern.search(mesh.log(process))
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def test_a_member_cut_off_until_its_lease_ends_fails_everywhere_and_rejoins(mesh):
    epoch = (await mesh.listed())["decode-0"]
    failed: list[str] = []

    async def doomed() -> None:  # in decode when the decode stops answering anyone
        try:
            await generate(mesh, "router-1", "cut off mid-request", max_tokens=4000)
        except grpc.aio.AioRpcError as e:
            failed.append(e.code().name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(doomed)
        await anyio.sleep(0.5)
        stopped = time.time()
        mesh.kill("decode-0", signal.SIGSTOP)  # no keep-alive, no answer: cut off
        try:
            await anyio.to_thread.run_sync(
                mesh.wait_until,
                lambda: all(_left_at(mesh, p, "decode-0", epoch) for p in PEERS)
                and "decode-0" not in mesh.members(), LEASE + 5, "decode-0 not evicted")
        finally:
            mesh.kill("decode-0", signal.SIGCONT)
    evicted = {p: _left_at(mesh, p, "decode-0", epoch) - stopped for p in PEERS}
    print("lease expiry to eviction, seconds after the member stopped:", evicted)
    # the last keep-alive came at most LEASE/4 before the stop: evicted within lease + 1 s
    assert max(evicted.values()) <= LEASE + 1.0, evicted
    assert failed, "the request in the cut-off decode did not fail"
    # it rejoins under a new epoch, and requests succeed through both routers again
    await anyio.to_thread.run_sync(
        mesh.wait_until, lambda: mesh.members().get("decode-0", epoch) > epoch, 20.0,
        "decode-0 did not rejoin")
    await anyio.sleep(0.5)
    for router in ("router-0", "router-1"):
        assert (await generate(mesh, router, "after the rejoin")).completion_tokens == 8


async def test_an_etcd_restart_changes_no_epoch_and_requests_go_on(mesh):
    before = await mesh.listed()
    departures = {p: mesh.log(p).count(" left: ") for p in PEERS}
    await anyio.to_thread.run_sync(mesh.etcd.stop)
    # etcd down: requests through both routers still run (membership is not on their path)
    for router in ("router-0", "router-1"):
        assert (await generate(mesh, router, "etcd is down")).completion_tokens == 8
    await anyio.sleep(1.0)
    await anyio.to_thread.run_sync(mesh.etcd.start)
    # every replica lists again; leases were renewed (etcd extends them on restart)
    await anyio.to_thread.run_sync(
        mesh.wait_until, lambda: mesh.members(0) == before and mesh.members(1) == before,
        15.0, "the replicas did not come back to the same members and epochs")
    await anyio.sleep(LEASE)  # a lease lost in the outage would expire by now
    assert await mesh.listed() == before
    assert {p: mesh.log(p).count(" left: ") for p in PEERS} == departures  # nobody left
    assert (await generate(mesh, "router-1", "etcd is back")).completion_tokens == 8


async def test_abort_storm_with_a_replica_and_a_router_killed(mesh):
    result = await storm(mesh, waves=4, concurrency=10, kill_wave=1)
    print("storm:", result)
    assert result["ok"], result
    assert result["pinned"] == 0 and result["lost"] == 0
    assert result["max_quiesce_s"] <= 1.0
