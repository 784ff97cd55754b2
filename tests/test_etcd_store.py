"""The etcd membership store against a real etcd: epochs, leases, the watched view on
every replica, foreign keys, an etcd that is down at start or restarts."""

from __future__ import annotations

import re
import time
import uuid

import anyio
import pytest
from aetcd import rpc
from prometheus_client import generate_latest

from pdmesh.etcdmesh import EtcdServer
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from services.bootstrap.etcd_store import MAGIC, EtcdStore, parse_store
from services.bootstrap.metrics import BootstrapMetrics
from services.bootstrap.registry import StaleEpoch
from services.bootstrap.store import StoreUnavailable
from services.router.core import RoomMinter


def member(name="decode-0", role=cpb.DECODE):
    return bpb.Member(role=role, name=name, address="127.0.0.1:1")


def prefix_url(server: EtcdServer) -> str:
    return f"etcd://{server.address}/t{uuid.uuid4().hex[:8]}"  # one namespace per test


class Replica:
    """One store with its background view running, and every event it published."""

    def __init__(self, url: str, lease: float = 2.0):
        self.store = EtcdStore(parse_store(url), lease_seconds=lease)
        self.events: list[tuple[int, str, int, str]] = []
        self.store.subscribe(lambda e: self.events.extend(
            (e.kind, m.name, m.epoch, e.reason) for m in e.members))

    def left(self, name: str) -> list[str]:
        return [reason for kind, who, _, reason in self.events
                if kind == bpb.MembershipEvent.LEFT and who == name]


async def until(check, timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        await anyio.sleep(0.02)
    return time.monotonic() - start


def test_parse_store():
    assert parse_store("memory") is None
    target = parse_store("etcd://10.0.0.1:2379")
    assert (target.address, target.prefix) == ("10.0.0.1:2379", "/pdmesh/")
    assert parse_store("etcd://h:1/a/b/").prefix == "/a/b/"
    for bad in ("etcd://nohost", "redis://h:1", "etcd:h:1"):
        with pytest.raises(ValueError):
            parse_store(bad)


async def test_two_replicas_share_epochs_leases_and_events(etcd_server):
    url = prefix_url(etcd_server)
    a, b = Replica(url), Replica(url)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.store.run)
        tg.start_soon(b.store.run)
        await a.store.wait_ready()
        await b.store.wait_ready()
        # registrations racing through both replicas at once: no two share an epoch
        admitted: list[bpb.Member] = []

        async def register(store, name):
            admitted.append(await store.register(member(name)))

        async with anyio.create_task_group() as racing:
            for i in range(10):
                racing.start_soon(register, (a, b)[i % 2].store, f"m{i}")
        assert len({m.epoch for m in admitted}) == 10
        await until(lambda: len(b.store.members()) == 10 and len(a.store.members()) == 10, 5)
        # a re-registration is a new, higher epoch; the old one is stale everywhere
        old = next(m for m in admitted if m.name == "m0")
        new = await b.store.register(member("m0"))
        assert new.epoch > old.epoch
        with pytest.raises(StaleEpoch):
            await a.store.keep_alive("m0", old.epoch)
        await a.store.keep_alive("m0", new.epoch)  # renewed through the other replica
        await until(lambda: "replaced by a new epoch" in a.left("m0"), 5)
        # a deregistration is told apart from an expiry on every replica
        await a.store.deregister("m0", new.epoch)
        await until(lambda: a.left("m0")[-1:] == ["deregistered"]
                    and b.left("m0")[-1:] == ["deregistered"], 5)
        with pytest.raises(StaleEpoch):
            await b.store.deregister("m0", new.epoch)
        tg.cancel_scope.cancel()


async def test_lease_expiry_evicts_within_lease_plus_one_second(etcd_server):
    url = prefix_url(etcd_server)
    a, b = Replica(url, lease=2.0), Replica(url, lease=2.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.store.run)
        tg.start_soon(b.store.run)
        await a.store.wait_ready()
        await b.store.wait_ready()
        quiet = await a.store.register(member("quiet"))
        alive = await a.store.register(member("alive"))
        silent_since = time.monotonic()  # "quiet" never renews from here on

        async def renew():
            while True:
                await anyio.sleep(0.5)
                await b.store.keep_alive("alive", alive.epoch)

        tg.start_soon(renew)
        await until(lambda: a.left("quiet") == ["lease expired"]
                    and b.left("quiet") == ["lease expired"], 2.0 + 3)
        evicted = time.monotonic() - silent_since
        assert evicted <= a.store.lease_seconds + 1.0, evicted
        assert [m.name for m in b.store.members()] == ["alive"]
        with pytest.raises(StaleEpoch):
            await a.store.keep_alive("quiet", quiet.epoch)
        tg.cancel_scope.cancel()


async def test_a_foreign_key_is_ignored_and_counted(etcd_server):
    url = prefix_url(etcd_server)
    replica = Replica(url)
    kv = rpc.KVStub(replica.store.channel)
    prefix = replica.store.members_prefix
    lease = await rpc.LeaseStub(replica.store.channel).LeaseGrant(rpc.LeaseGrantRequest(TTL=30))
    forged = bpb.Member(role=cpb.DECODE, name="other", address="10.9.9.9:1", epoch=1)
    writes = [
        (prefix + b"garbage", b"not a member at all", lease.ID),
        (prefix + b"nolease", MAGIC + member("nolease").SerializeToString(), 0),
        (prefix + b"victim", MAGIC + forged.SerializeToString(), lease.ID),  # name differs
    ]
    for key, value, lease_id in writes[:1]:
        await kv.Put(rpc.PutRequest(key=key, value=value, lease=lease_id))
    async with anyio.create_task_group() as tg:
        tg.start_soon(replica.store.run)
        await replica.store.wait_ready()
        assert replica.store.foreign_keys_total == 1  # found by the first list
        for key, value, lease_id in writes[1:]:  # and by the watch
            await kv.Put(rpc.PutRequest(key=key, value=value, lease=lease_id))
        real = await replica.store.register(member("real"))
        await until(lambda: [m.name for m in replica.store.members()] == ["real"], 5)
        assert replica.store.foreign_keys_total == 3
        # a foreign write over a registration: the registration is gone, not replaced
        doomed = await replica.store.register(member("doomed"))
        await until(lambda: len(replica.store.members()) == 2, 5)
        await kv.Put(rpc.PutRequest(key=prefix + b"doomed", value=b"forged", lease=lease.ID))
        await until(lambda: replica.left("doomed") == ["overwritten by a foreign key"], 5)
        assert replica.store.foreign_keys_total == 4
        with pytest.raises(StaleEpoch):
            await replica.store.keep_alive("doomed", doomed.epoch)
        assert replica.store.members()[0].epoch == real.epoch
        assert {who for _, who, _, _ in replica.events} == {"real", "doomed"}
        scraped = generate_latest(BootstrapMetrics(replica.store).prometheus).decode()
        assert re.search(r"^pdmesh_store_foreign_keys_total\{.*\} 4\.0$", scraped, re.M)
        assert re.search(r"^pdmesh_store_up\{.*\} 1\.0$", scraped, re.M)
        tg.cancel_scope.cancel()


async def test_etcd_down_at_start_then_restarted(tmp_path, etcd_installed):
    server = EtcdServer(tmp_path / "etcd")
    replica = Replica(f"etcd://{server.address}/pdmesh", lease=3.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(replica.store.run)
        # down: calls fail with a typed, retryable error; the view is not served
        with pytest.raises(StoreUnavailable):
            await replica.store.register(member())
        assert not replica.store.connected
        await anyio.to_thread.run_sync(server.start)
        try:
            await until(lambda: replica.store.connected, 10)  # it retried on its own
            kept = await replica.store.register(member("kept"))
            await until(lambda: len(replica.store.members()) == 1, 5)
            # etcd restarts: the registration, its lease and its epoch survive
            await anyio.to_thread.run_sync(server.stop)
            with pytest.raises(StoreUnavailable):
                await replica.store.keep_alive("kept", kept.epoch)
            await anyio.to_thread.run_sync(server.start)
            await until(lambda: replica.store.connected, 10)
            await replica.store.keep_alive("kept", kept.epoch)
            assert [(m.name, m.epoch) for m in replica.store.members()] == [("kept", kept.epoch)]
            assert replica.left("kept") == []  # nobody was told it left
        finally:
            await anyio.to_thread.run_sync(server.stop)
        tg.cancel_scope.cancel()


def test_two_routers_minting_at_once_never_collide():
    a, b = RoomMinter("router-0"), RoomMinter("router-1")
    assert a.tag != b.tag and len(a.tag) == 8
    rooms_a = {a.mint().room for _ in range(20000)}
    rooms_b = {b.mint().room for _ in range(20000)}
    assert len(rooms_a) == len(rooms_b) == 20000
    assert not rooms_a & rooms_b
    assert all(len(r) == 16 and r[:8] == a.tag for r in rooms_a)



def test_a_bootstrap_whose_etcd_is_down_keeps_running_and_says_so(tmp_path):
    """Not a crash loop: one line per attempt, backing off; Register answers UNAVAILABLE."""
    import subprocess
    import sys

    from pdmesh.localmesh import free_ports

    boot, dead = free_ports(2)
    log = tmp_path / "bootstrap.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "pdmesh.cli", "bootstrap", "--port", str(boot),
         "--store", f"etcd://127.0.0.1:{dead}"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while log.read_text().count("unreachable") < 3 and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        lines = [line for line in text.splitlines() if "unreachable" in line]
        assert len(lines) >= 3, text
        assert f"membership store etcd://127.0.0.1:{dead}/pdmesh unreachable" in lines[0]
        delays = [float(re.search(r"retrying in ([\d.]+)s", line).group(1)) for line in lines]
        assert delays == sorted(delays) and delays[-1] > delays[0]  # backing off
        assert "Traceback" not in text and process.poll() is None
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("command", ["router", "decode"])
def test_a_bad_bootstrap_list_is_a_usage_error(command, capsys):
    from pdmesh.cli import build_parser

    parser = build_parser()
    ok = parser.parse_args([command, "--bootstrap", "10.0.0.1:50050,10.0.0.2:50050"])
    assert ok.bootstrap == "10.0.0.1:50050,10.0.0.2:50050"
    for bad in (",", "10.0.0.1:50050,nohost", "a:b"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--bootstrap", bad])
        assert "--bootstrap" in capsys.readouterr().err
