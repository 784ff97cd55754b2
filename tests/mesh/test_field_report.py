"""The field report's 13 "mechanisms that must not exist in pdmesh", one test each.

Each test aims at its window with the fault injection points of libs/faults (a
pause between computing a chunk and posting its write, a held Abort, a held or
dropped notification, an injected prefill failure) instead of hoping a random
load finds it. Real processes under `pdmesh up`, real gRPC, real NIXL, tiny model.
docs/design.md lists the 13 mechanisms and the protection each test checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nixl._api import nixl_agent, nixl_agent_config

from libs.rpc.calls import open_channel, unary
from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc

PAUSE = 1.0  # seconds a faulted prefill waits between computing a chunk and writing it
WORDS = "river engine harbour lantern meadow copper signal orchard thunder violet".split()


def words(n: int, salt: int = 0) -> str:
    """n words, one tiny-model token each."""
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n))


def mesh_fixture(name: str, faults: str = "", up_args: tuple[str, ...] = (),
                 scope: str = "function", **kwargs):
    """A tiny mesh started with these faults and `pdmesh up` flags. Function-scoped unless
    several tests share it (scope="module"): a module-scoped mesh lives, idle but polling,
    until its module ends, and this module would otherwise hold a dozen at once."""
    if faults:
        up_args = (*up_args, "--faults", faults)

    @pytest.fixture(scope=scope)
    def mesh(tmp_path_factory):
        started = start_mesh(tmp_path_factory.mktemp(name), model="tiny",
                             up_args=list(up_args), **kwargs)
        yield started
        started.stop()

    return mesh


paused_mesh = mesh_fixture("paused", f"pause_between_chunks={PAUSE}")


async def status(mesh) -> dict:
    return await anyio.to_thread.run_sync(mesh.status)


async def member(mesh, role: str) -> dict:
    return next(m for m in (await status(mesh))["members"] if m["role"] == role)


def ref(m: dict) -> cpb.PeerRef:
    return cpb.PeerRef(name=m["name"], epoch=m["epoch"])


async def generate(mesh, prompt: str, max_tokens: int, **kw) -> tuple[list[int], str]:
    """Token ids and finish reason of one request through the router's gRPC API."""
    ids, finish = [], None
    async with GenerateClient(mesh.router, timeout=60) as client:
        async for item in client.generate(prompt=prompt, max_tokens=max_tokens, **kw):
            if isinstance(item, Piece):
                ids += item.token_ids
            elif isinstance(item, Done):
                finish = item.finish_reason
    return ids, finish


async def drain(call) -> list:
    """The rest of a stream whose first message was taken with read() (grpc.aio forbids
    mixing read() and iteration on one call)."""
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


async def until(predicate, timeout: float, every: float = 0.02):
    """Poll an async predicate; its first truthy value, or AssertionError at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := await predicate():
            return value
        await anyio.sleep(every)
    raise AssertionError(f"not within {timeout}s")


# ---- 1. a control loop that one bad message kills while health stays green ---------


async def test_m01_raw_frames_and_garbage_kill_no_loop(tiny_mesh):
    """The field report's control thread died on a raw abort frame while health stayed
    green. Here an outside NIXL agent sends raw notification frames (garbage, a KvReady
    for no room, one naming the wrong writer) and garbage gRPC bodies hit every Decode
    method; the same decode process (same pid and epoch) then serves, healthy."""
    before = await member(tiny_mesh, "decode")
    channel = open_channel(tiny_mesh.bootstrap)
    try:
        members = (await unary(bgrpc.BootstrapStub(channel).ListMembers,
                               bpb.ListMembersRequest(), timeout=5)).members
    finally:
        await channel.close()
    decode = next(m for m in members if m.role == cpb.DECODE)
    intruder = nixl_agent("intruder", nixl_agent_config(backends=["UCX"]))
    remote = intruder.add_remote_agent(decode.nixl_metadata)
    forged = cpb.KvReady(key=cpb.RoomKey(room=b"\x01" * 16, generation=1),
                         prefill=cpb.PeerRef(name="prefill-0", epoch=1), num_pages=3)
    for frame in (b"\xff" * 64, b"abort", forged.SerializeToString(), b"\x0a\x02\x00"):
        intruder.send_notif(remote, frame)
    channel = open_channel(before["address"])
    try:
        for method in ("/pdmesh.v1.Decode/Abort", "/pdmesh.v1.Decode/Generate",
                       "/pdmesh.v1.Admin/Stats"):
            call = channel.unary_unary(method) if "Generate" not in method \
                else channel.unary_stream(method)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                result = call(b"\xff\xfe garbage", timeout=5)
                if "Generate" in method:
                    async for _ in result:
                        pass
                else:
                    await result
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
    # The next room makes the decode's poller drain the raw frames with its KvReady.
    ids, finish = await generate(tiny_mesh, words(40), 8, ignore_eos=True)
    assert len(ids) == 8 and finish == "length"
    after = await member(tiny_mesh, "decode")
    assert (after["pid"], after["epoch"], after["healthy"]) == (
        before["pid"], before["epoch"], True)
    intruder.remove_remote_agent(remote)


# Every prefill forward blocks its compute thread 3 s; health turns red after 1 s.
wedged_mesh = mesh_fixture("wedged", "stall_forward=3",
                           up_args=["--prefill-args", "--stall-after 1"])


async def test_m01_a_wedged_loop_turns_health_red_then_green(wedged_mesh):
    """The other half of mechanism 1: health that stays green while a loop is stuck.
    While the prefill's compute thread is blocked with work in flight, its standard
    grpc.health.v1 check says NOT_SERVING (and Stats healthy false); once the pass
    finishes the request completes and health is SERVING again."""
    prefill = await member(wedged_mesh, "prefill")
    channel = open_channel(prefill["address"])
    seen: list[int] = []
    try:
        check = health_pb2_grpc.HealthStub(channel).Check

        async def health() -> int:
            return (await check(health_pb2.HealthCheckRequest(), timeout=5)).status

        assert await health() == health_pb2.HealthCheckResponse.SERVING
        async with anyio.create_task_group() as tg:
            done: list = []

            async def request():
                done.append(await generate(wedged_mesh, words(40), 4, ignore_eos=True))

            tg.start_soon(request)

            async def red():
                seen.append(await health())
                return seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING

            await until(red, 2.9, every=0.1)
            assert not (await member(wedged_mesh, "prefill"))["healthy"]
        assert len(done[0][0]) == 4

        async def green():
            return await health() == health_pb2.HealthCheckResponse.SERVING

        await until(green, 2.0, every=0.1)
    finally:
        await channel.close()


# ---- 2. an abort that reaches one side only -----------------------------------------


async def test_m02_a_client_gone_between_chunks_aborts_both_legs(paused_mesh):
    """The client leaves while the prefill sits between two chunks: the router cancels
    both legs and both members release at once, and the prefill never computes the
    remaining chunks (its prompt-token counter stops at the first chunk's 256)."""
    before = {m["role"]: m for m in (await status(paused_mesh))["members"]}
    with anyio.move_on_after(0.3):  # chunk 1 computed; the pause lasts until ~PAUSE
        await generate(paused_mesh, words(700), 16)
    left = time.monotonic()
    await anyio.to_thread.run_sync(wait_quiet, paused_mesh, PAUSE * 0.3)
    assert time.monotonic() - left < PAUSE * 0.3
    after = {m["role"]: m for m in (await status(paused_mesh))["members"]}
    for role in ("prefill", "decode"):
        gone = after[role]["aborts_by_reason"].get("client_disconnect", 0)
        assert gone == before[role]["aborts_by_reason"].get("client_disconnect", 0) + 1, role
    await anyio.sleep(PAUSE * 2.5)  # long enough for the other two chunks, had they run
    computed = (await member(paused_mesh, "prefill"))["prompt_tokens_computed_total"]
    assert computed - before["prefill"]["prompt_tokens_computed_total"] == 256  # chunk 1 only


# ---- 3. freeing decode pages while a write into them can still land (W4) ------------


# The prefill pauses before each write and holds every Abort 1.5 s: a write into
# a room the decode already ended lands PAUSE seconds after the room ended.
w4_mesh = mesh_fixture("w4", f"pause_between_chunks={PAUSE},delay_abort=1.5")


async def test_m03_a_late_write_never_lands_in_another_requests_pages(w4_mesh):
    """Room A's decode leg ends (no router, no Abort) before A's first write is posted;
    the prefill posts it PAUSE seconds later. Request B starts right after A ended and
    is still decoding when A's late write lands. B's tokens must equal B run alone:
    A's pages stayed quarantined until the writer was fenced, so B never got them."""
    prefill, decode = await member(w4_mesh, "prefill"), await member(w4_mesh, "decode")
    key = cpb.RoomKey(room=os.urandom(16), generation=3)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=16)
    d_channel, p_channel = open_channel(decode["address"]), open_channel(prefill["address"])
    prompt_b = words(20, salt=3)
    try:
        a_decode = dgrpc.DecodeStub(d_channel).Generate(dpb.DecodeRequest(
            key=key, prompt_tokens=600, sampling=sampling, prefill=ref(prefill)), timeout=30)
        info = (await a_decode.read()).transfer
        a_prefill = pgrpc.PrefillStub(p_channel).Prefill(ppb.PrefillRequest(
            key=key, prompt_tokens=[(7 * i) % 40000 + 50 for i in range(600)],
            sampling=sampling, transfer=info), timeout=30)
        await anyio.sleep(0.3)  # chunk 1 computed, its write not posted yet
        a_decode.cancel()
        quarantined = await member(w4_mesh, "decode")
        assert quarantined["kv_pages_used"] == len(info.dst_pages) + 1  # held, not freed
        b_ids, _ = await generate(w4_mesh, prompt_b, 600, ignore_eos=True)
        a_end = None
        with anyio.move_on_after(10):
            try:
                async for _ in a_prefill:
                    pass
                a_end = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                a_end = e.code()
        alone, _ = await generate(w4_mesh, prompt_b, 600, ignore_eos=True)
    finally:
        await d_channel.close()
        await p_channel.close()
    assert b_ids == alone
    assert a_end == grpc.StatusCode.ABORTED  # stopped by the decode's own fence request
    await anyio.to_thread.run_sync(wait_quiet, w4_mesh, 5.0)


# ---- 4. room ids taken from clients, or reused ----------------------------------------


async def test_m04_rooms_are_minted_and_duplicates_refused(tiny_mesh):
    """Clients cannot name rooms (the router mints them: identical concurrent requests
    get distinct rooms); a duplicate (room, generation) is refused with ALREADY_EXISTS
    while live and refused again after it ended; Aborts naming a stale epoch or another
    writer are refused without touching the room; nothing leaks."""
    before = await member(tiny_mesh, "decode")
    results = []

    async def same_request():
        results.append(await generate(tiny_mesh, words(30), 6, ignore_eos=True))

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(same_request)
    assert [len(ids) for ids, _ in results] == [6] * 6
    assert (await member(tiny_mesh, "decode"))["requests_total"] == before["requests_total"] + 6

    prefill = await member(tiny_mesh, "prefill")
    key = cpb.RoomKey(room=os.urandom(16), generation=11)
    request = dpb.DecodeRequest(key=key, prompt_tokens=20, prefill=ref(prefill),
                                sampling=cpb.SamplingParams(top_p=1, max_tokens=4))
    channel = open_channel(before["address"])
    try:
        stub = dgrpc.DecodeStub(channel)
        first = stub.Generate(request, timeout=30)
        assert (await first.read()).HasField("transfer")
        for attempt in ("live", "ended"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(request, timeout=10):
                    pass
            expected = grpc.StatusCode.ALREADY_EXISTS if attempt == "live" \
                else grpc.StatusCode.ABORTED
            assert err.value.code() == expected, (attempt, err.value.details())
            if attempt == "live":
                # Aborts for another life of this decode, or naming another writer, are
                # refused and leave the live room alone (invariant 6).
                stale = cpb.PeerRef(name=before["name"], epoch=before["epoch"] - 1)
                other = cpb.PeerRef(name=prefill["name"], epoch=prefill["epoch"] + 7)
                for forged in (cpb.Abort(key=key, reason="client_disconnect", decode=stale),
                               cpb.Abort(key=key, reason="client_disconnect", prefill=other)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await unary(stub.Abort, forged, timeout=10)
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                live = await member(tiny_mesh, "decode")
                assert live["rooms"] == {"waiting_for_input": 1}
                ack = await unary(stub.Abort, cpb.Abort(
                    key=key, reason="client_disconnect", writer_fenced=True,
                    decode=ref(before), prefill=ref(prefill)), timeout=10)
                assert ack.known and ack.released
    finally:
        await channel.close()
    await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 2.0)


# ---- 5. a state machine where a late write leaves a terminal state --------------------


# The final, notifying write is posted 1.5 s late; Aborts are held 3 s, so
# nothing stops the late write: the field report's resurrection sequence.
late_mesh = mesh_fixture("late", "delay_kv_ready=1.5,delay_abort=3")


async def test_m05_a_late_kv_ready_does_not_revive_a_failed_room(late_mesh):
    """The decode's room fails at its deadline; the prefill's KvReady lands after it.
    The room stays Failed (no token is ever streamed for it), and the late write is
    taken as the fence that frees its quarantined pages, long before the held Abort."""
    prefill, decode = await member(late_mesh, "prefill"), await member(late_mesh, "decode")
    key = cpb.RoomKey(room=os.urandom(16), generation=5)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=8)
    d_channel, p_channel = open_channel(decode["address"]), open_channel(prefill["address"])
    states: list[dict] = []
    try:
        a_decode = dgrpc.DecodeStub(d_channel).Generate(dpb.DecodeRequest(
            key=key, prompt_tokens=40, sampling=sampling, prefill=ref(prefill)), timeout=0.6)
        info = (await a_decode.read()).transfer
        a_prefill = pgrpc.PrefillStub(p_channel).Prefill(ppb.PrefillRequest(
            key=key, prompt_tokens=list(range(200, 240)), sampling=sampling, transfer=info),
            timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            streamed = await drain(a_decode)
            raise AssertionError(f"a failed room streamed {streamed}")
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        async with anyio.create_task_group() as tg:
            async def watch():
                while True:
                    states.append((await member(late_mesh, "decode"))["rooms"])
                    await anyio.sleep(0.02)
            tg.start_soon(watch)
            events = [e async for e in a_prefill]  # the late success, from the prefill's side
            landed = time.monotonic()
            await anyio.to_thread.run_sync(wait_quiet, late_mesh, 1.0)
            freed_after = time.monotonic() - landed
            tg.cancel_scope.cancel()
    finally:
        await d_channel.close()
        await p_channel.close()
    assert events[-1].result.status == cpb.TRANSFER_OK
    assert freed_after < 1.0  # freed by the late KvReady, not by the Abort held 3 s
    assert all(set(rooms) <= {"failed"} for rooms in states), states
    assert (await member(late_mesh, "decode"))["deadline_expired_total"] == \
        decode["deadline_expired_total"] + 1


# ---- 6. per-room state created by anyone who reaches a socket; unbounded tables -------


bounded_mesh = mesh_fixture("bounded", up_args=("--decode-args", "--max-rooms 4 --pinned-after 1",
                                                 "--prefill-args", "--max-rooms 4",
                                                 "--router-args", "--max-queue 8"),
                            scope="module")


async def test_m06_forged_messages_create_nothing_and_floods_are_refused(bounded_mesh):
    """A TransferInfo the decode never granted creates no room on the prefill; a flood
    past the bound of 4 rooms waits in the router's queue of 8, past that it gets typed
    RESOURCE_EXHAUSTED at once, the rest complete, and the mesh is quiescent and serving
    afterwards."""
    prefill, decode = await member(bounded_mesh, "prefill"), await member(bounded_mesh, "decode")
    forged = cpb.TransferInfo(key=cpb.RoomKey(room=os.urandom(16), generation=1),
                              decode=ref(decode), dst_pages=[0, 1])
    forged.grant = b"\x00" * 32
    channel = open_channel(prefill["address"])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pgrpc.PrefillStub(channel).Prefill(ppb.PrefillRequest(
                    key=forged.key, prompt_tokens=list(range(5, 25)), transfer=forged,
                    sampling=cpb.SamplingParams(top_p=1, max_tokens=1)), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await channel.close()
    after = await member(bounded_mesh, "prefill")
    assert after["rooms"] == {} and after["requests_total"] == prefill["requests_total"] + 1

    outcomes: dict[str, int] = {}

    async def one(i: int):
        try:
            ids, _ = await generate(bounded_mesh, words(60, salt=i), 48, ignore_eos=True)
            kind = "ok" if len(ids) == 48 else "short"
        except grpc.aio.AioRpcError as e:
            kind = e.code().name
        outcomes[kind] = outcomes.get(kind, 0) + 1

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(one, i)
    assert set(outcomes) == {"ok", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["ok"] >= 4 + 8  # the rooms' worth, then the queue's
    await anyio.to_thread.run_sync(wait_quiet, bounded_mesh, 2.0)
    ids, _ = await generate(bounded_mesh, words(10), 4, ignore_eos=True)
    assert len(ids) == 4


async def test_status_names_a_pinned_room(bounded_mesh):
    """Evidence instead of silence: a room that makes no progress (its KV never comes)
    shows up in `pdmesh status` as pinned, with its state, idle time and peer."""
    prefill, decode = await member(bounded_mesh, "prefill"), await member(bounded_mesh, "decode")
    channel = open_channel(decode["address"])
    try:
        call = dgrpc.DecodeStub(channel).Generate(dpb.DecodeRequest(
            key=cpb.RoomKey(room=os.urandom(16), generation=2), prompt_tokens=20,
            sampling=cpb.SamplingParams(top_p=1, max_tokens=4), prefill=ref(prefill)),
            timeout=30)
        assert (await call.read()).HasField("transfer")
        await anyio.sleep(1.5)  # past this decode's --pinned-after 1
        shown = await anyio.to_thread.run_sync(bounded_mesh.status_cli)
        text = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "pdmesh.cli", "status", "--bootstrap", bounded_mesh.bootstrap],
            capture_output=True, text=True, timeout=60, env=bounded_mesh.env()).stdout)
        call.cancel()
    finally:
        await channel.close()
    (pinned,) = next(m for m in shown["members"] if m["role"] == "decode")["pinned"]
    assert pinned["state"] == "waiting_for_input" and pinned["peer"] == prefill["name"]
    assert pinned["idle_seconds"] >= 1.0
    assert f"PINNED on {decode['name']}" in text and pinned["room"][:12] in text
    await anyio.to_thread.run_sync(wait_quiet, bounded_mesh, 3.0)


# ---- 7. a restarted peer's old agent kept; a dead peer's rooms waiting for a timeout ---


kill_mesh = mesh_fixture("kill", f"pause_between_chunks={PAUSE}",
                         up_args=["--router-args", "--retries 0"], scope="module")


@pytest.mark.parametrize("victim", ["decode", "prefill"])
async def test_m07_a_peer_killed_between_chunks(kill_mesh, victim):
    """SIGKILL the decode (or the prefill) while the prefill sits between two chunks.
    The request fails typed within 3 s (not at its 300 s budget), the survivor's room
    fails within 3 s, the killed member comes back under a new epoch, the survivor's
    quarantined pages come back with that epoch change, and the survivor (never
    restarted) serves with the new member: its old agent was dropped."""
    survivor_role = "prefill" if victim == "decode" else "decode"
    before = {m["role"]: m for m in (await status(kill_mesh))["members"]}
    failed: list = []

    async def request():
        try:
            await generate(kill_mesh, words(700), 16)
        except grpc.aio.AioRpcError as e:
            failed.append((time.monotonic(), e.code()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await anyio.sleep(0.4)  # chunk 1 computed, the prefill paused before its write
        os.kill(before[victim]["pid"], signal.SIGKILL)
        killed = time.monotonic()

        async def survivor_failed_its_rooms():
            return not (await member(kill_mesh, survivor_role))["inflight"]

        await until(survivor_failed_its_rooms, 3.0)
    (when, code), = failed
    assert when - killed < 3.0 and code == grpc.StatusCode.UNAVAILABLE

    async def back():
        m = next((m for m in (await status(kill_mesh))["members"]
                  if m["role"] == victim and m["healthy"]), None)
        return m if m and m["epoch"] != before[victim]["epoch"] else None

    await until(back, 60, every=0.2)
    # Pages a dead writer may still have been writing are fenced by its epoch ending
    # (invariant 5), not by a timer: they are back once the new epoch registered.
    await anyio.to_thread.run_sync(wait_quiet, kill_mesh, 2.0)
    ids, _ = await generate(kill_mesh, words(100), 8, ignore_eos=True)  # one chunk: no pause
    assert len(ids) == 8
    after = {m["role"]: m for m in (await status(kill_mesh))["members"]}
    assert after[survivor_role]["pid"] == before[survivor_role]["pid"]
    assert after[survivor_role]["epoch"] == before[survivor_role]["epoch"]


# ---- 8. timeouts as the only failure signal; deadlines before pending events drain ----


slow_notif_mesh = mesh_fixture("slownotif",
                               "fail_prefills=1,decode-0:delay_notifications=1.5",
                               up_args=["--router-args", "--retries 0"])


async def test_m08_failures_are_signals_and_deadlines_drain_first(slow_notif_mesh):
    """(a) A prefill that fails mid-request fails the request, typed, at once (budget
    300 s) and the decode's room with it. (b) A KvReady that arrived well before its
    room's deadline but is still pending in the decode's poller when the deadline passes
    is drained first: the room succeeds and the request completes. (A 2 s call leaves
    its room 1.5 s to receive the KV; the poller holds the KvReady 1.5 s.)"""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(slow_notif_mesh, words(300), 8)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "injected" in err.value.details()
    assert time.monotonic() - started < 2.0
    await anyio.to_thread.run_sync(wait_quiet, slow_notif_mesh, 1.0)

    prefill = await member(slow_notif_mesh, "prefill")
    decode = await member(slow_notif_mesh, "decode")
    key = cpb.RoomKey(room=os.urandom(16), generation=8)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=1)
    d_channel, p_channel = open_channel(decode["address"]), open_channel(prefill["address"])
    try:
        started = time.monotonic()
        call = dgrpc.DecodeStub(d_channel).Generate(dpb.DecodeRequest(
            key=key, prompt_tokens=20, sampling=sampling, prefill=ref(prefill)), timeout=2.0)
        info = (await call.read()).transfer
        events = [e async for e in pgrpc.PrefillStub(p_channel).Prefill(ppb.PrefillRequest(
            key=key, prompt_tokens=list(range(300, 320)), sampling=sampling, transfer=info),
            timeout=10)]
        assert events[-1].result.status == cpb.TRANSFER_OK
        assert time.monotonic() - started < 0.45  # the KvReady is pending from here on
        rest = await drain(call)
        assert rest[-1].finish.completion_tokens == 1
        assert time.monotonic() - started > 1.5  # it was handled after the room's deadline
    finally:
        await d_channel.close()
        await p_channel.close()
    await anyio.to_thread.run_sync(wait_quiet, slow_notif_mesh, 3.0)
    after = await member(slow_notif_mesh, "decode")
    assert after["deadline_expired_total"] == decode["deadline_expired_total"]


# ---- 9. decisions that need identical queues on every rank -----------------------------


two_prefill_mesh = mesh_fixture("twoprefill", prefill=2)


async def test_m09_no_decision_waits_for_a_stalled_member(two_prefill_mesh):
    """Every room has one owner that decides alone; nothing waits for all members to
    agree. With prefill-1 frozen (SIGSTOP), requests keep completing through prefill-0
    without waiting on it, those that landed on prefill-1 are failed over once its lease
    ends (5 s), and nothing stays pinned."""
    members = {m["name"]: m for m in (await status(two_prefill_mesh))["members"]}
    frozen = members["prefill-1"]
    os.kill(frozen["pid"], signal.SIGSTOP)
    done: list[float] = []
    try:
        started = time.monotonic()

        async def one(i: int):
            ids, _ = await generate(two_prefill_mesh, words(40, salt=i), 8, ignore_eos=True)
            assert len(ids) == 8
            done.append(time.monotonic() - started)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    assert len(done) == 6
    assert min(done) < 2.0  # served by prefill-0 while prefill-1 was frozen
    await anyio.to_thread.run_sync(wait_quiet, two_prefill_mesh, 10.0)


# ---- 10. a transfer backend whose only failure signal is "never done" -----------------


dropped_mesh = mesh_fixture("dropped", "drop_kv_ready=1",
                            up_args=["--router-args", "--retries 0"])


async def test_m10_a_lost_notification_is_reported_not_waited_for(dropped_mesh):
    """The prefill's last write lands without its KvReady, so the decode never learns
    the KV arrived. The router, told by the prefill that every page was written, fails
    the request typed within its 5 s grace instead of waiting out the 300 s budget,
    and the decode's pages come back (the writer is fenced: its call ended)."""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(dropped_mesh, words(40), 8)
    took = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "KvReady" in err.value.details()
    assert 4.0 < took < 8.0
    await anyio.to_thread.run_sync(wait_quiet, dropped_mesh, 1.0)


# ---- 11. configuration mismatches that show up as hangs --------------------------------


async def test_m11_a_mismatched_decode_is_refused_not_hung(tiny_mesh, tmp_path):
    """A decode with another page size joins the mesh. Nobody pairs with it: the router
    never picks it, and a request sent to it directly is refused at once, typed."""
    log = (tmp_path / "odd.log").open("w")
    odd = subprocess.Popen(
        [sys.executable, "-m", "pdmesh.cli", "decode", "--name", "decode-odd", "--model", "tiny",
         "--page-size", "32", "--kv-pages", "64", "--bootstrap", tiny_mesh.bootstrap],
        stdout=log, stderr=subprocess.STDOUT, env=tiny_mesh.env("decode"),
    )
    try:
        async def joined():
            return next((m for m in (await status(tiny_mesh))["members"]
                         if m["name"] == "decode-odd" and m["healthy"]), None)

        odd_member = await until(joined, 60, every=0.2)
        for i in range(4):
            ids, _ = await generate(tiny_mesh, words(30, salt=i), 4, ignore_eos=True)
            assert len(ids) == 4
        prefill = await member(tiny_mesh, "prefill")
        channel = open_channel(odd_member["address"])
        try:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in dgrpc.DecodeStub(channel).Generate(dpb.DecodeRequest(
                        key=cpb.RoomKey(room=os.urandom(16), generation=1), prompt_tokens=20,
                        sampling=cpb.SamplingParams(top_p=1, max_tokens=4),
                        prefill=ref(prefill)), timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert time.monotonic() - started < 1.0
        finally:
            await channel.close()
        odd_now = next(m for m in (await status(tiny_mesh))["members"]
                       if m["name"] == "decode-odd")
        assert odd_now["requests_total"] == 1  # only ours: the router never picked it
    finally:
        odd.send_signal(signal.SIGTERM)
        odd.wait(30)
        log.close()
    assert "page_size differs" in (tmp_path / "odd.log").read_text()

    async def gone():
        return all(m["name"] != "decode-odd" for m in (await status(tiny_mesh))["members"])

    await until(gone, 10)


# ---- 12. a late success over a pending abort; an aborted request reported as length ---


# The first 4 Prefill calls fail after one chunk; the router retries once.
failing_mesh = mesh_fixture("failing", "fail_prefills=4")


def test_m12_an_aborted_request_is_never_a_200_with_finish_length(failing_mesh):
    """A request the mesh could not serve is an OpenAI error (503, error object), never
    a 200 whose finish_reason says `length`; streaming too. The next request is fine."""
    client = openai.OpenAI(base_url=failing_mesh.base_url, api_key="x", max_retries=0)
    long = [{"role": "user", "content": words(300)}]
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=8)
    assert err.value.status_code == 503 and "injected" in str(err.value.body)
    with pytest.raises(openai.APIStatusError) as err:
        for _ in client.chat.completions.create(model="tiny", messages=long, max_tokens=8,
                                                stream=True):
            pass
    assert err.value.status_code == 503
    ok = client.chat.completions.create(model="tiny", messages=long, max_tokens=8)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 8
    wait_quiet(failing_mesh, 1.0)


# ---- 13. retries that start before the previous attempt's legs are cancelled ----------


# The decode's pool holds ONE request of the test's size (25 pages of 40): a retry
# that started before the failed attempt's decode leg released its pages would be
# refused RESOURCE_EXHAUSTED.
retry_mesh = mesh_fixture("retry", "fail_prefills=1",
                          up_args=["--decode-kv-pages", "40"])


async def test_m13_a_retry_starts_only_after_the_failed_attempt_was_released(retry_mesh):
    before = await member(retry_mesh, "decode")
    ids, finish = await generate(retry_mesh, words(300), 100, ignore_eos=True)
    assert len(ids) == 100 and finish == "length"
    after = await member(retry_mesh, "decode")
    assert after["requests_total"] == before["requests_total"] + 2  # the failed try, the retry
    assert sum(after["aborts_by_reason"].values()) == sum(before["aborts_by_reason"].values()) + 1
    metrics = await anyio.to_thread.run_sync(
        lambda: __import__("urllib.request").request.urlopen(
            f"http://127.0.0.1:{retry_mesh.http_port}/metrics").read().decode())
    assert "pdmesh_retries_total" in metrics and any(
        line.startswith("pdmesh_retries_total") and line.endswith(" 1.0")
        for line in metrics.splitlines())
    await anyio.to_thread.run_sync(wait_quiet, retry_mesh, 1.0)


# A decode step longer than the decode's release bound (decode_release_seconds, 2 s), as
# on a host too loaded to finish one step in time.
slow_step_mesh = mesh_fixture("slowstep", "decode-0:stall_step=2.5")


async def test_a_release_cut_short_by_a_slow_step_frees_the_room_once_the_step_ends(
        slow_step_mesh):
    from libs.member.timeouts import TIMEOUTS

    assert TIMEOUTS.decode_release_seconds < 2.5  # the fault outlasts the bound
    async with GenerateClient(slow_step_mesh.router) as client:
        async for _item in client.generate(prompt="tell me a story", max_tokens=50,
                                           ignore_eos=True):
            break  # the prefill's token: the sequence is in the batch, mid-step
    # cancelled mid-step: the release's bound ends first, the step later; the room and
    # its pages must still come back (they stayed held for good when the release
    # stopped at its bound)
    status = await anyio.to_thread.run_sync(wait_quiet, slow_step_mesh, 15.0)
    decode = [m for m in status["members"] if m["role"] == "decode"][0]
    assert decode["aborts_total"] >= 1
