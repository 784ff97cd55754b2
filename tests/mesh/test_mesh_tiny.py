"""The whole mesh, really started (tiny model): OpenAI client, gRPC client, status,
bad input on HTTP and gRPC, and a cancelled request that leaves nothing behind."""

from __future__ import annotations

import json
import time

import anyio
import grpc
import httpx
import openai
import pytest

from libs.rpc.calls import open_channel
from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import wait_quiet
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2 as dpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import generate_pb2 as gpb
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc


def test_openai_client_streaming_and_not(tiny_mesh):
    client = openai.OpenAI(base_url=tiny_mesh.base_url, api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0, stream=True,
    ))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: same text both ways
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_seeded_sampling_is_reproducible(tiny_mesh):
    client = openai.OpenAI(base_url=tiny_mesh.base_url, api_key="unused")

    def run(seed):
        return client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=2.0,
            top_p=1.0, seed=seed,
        ).choices[0].text

    assert run(7) == run(7)
    assert len({run(s) for s in (1, 2, 3)}) > 1


async def test_grpc_client_streams_tokens(tiny_mesh):
    async with GenerateClient(tiny_mesh.router) as client:
        assert await client.models() == ["tiny"]
        items = [i async for i in client.generate(prompt="abc", max_tokens=5)]
    assert isinstance(items[-1], Done)
    assert items[-1].completion_tokens == sum(len(i.token_ids) for i in items[:-1])
    assert all(isinstance(i, Piece) for i in items[:-1])


async def test_cancelled_grpc_request_leaves_nothing_behind(tiny_mesh):
    async with GenerateClient(tiny_mesh.router) as client:
        got = 0
        async for _item in client.generate(prompt="tell me " * 200, max_tokens=2000):
            got += 1
            if got == 3:
                break  # leaving the loop cancels the RPC
    status = await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 2.0)
    decode = [m for m in status["members"] if m["role"] == "decode"][0]
    assert decode["aborts_total"] >= 1


def test_status_json_shape(tiny_mesh):
    status = tiny_mesh.status_cli()
    assert status["bootstrap"]["address"] == tiny_mesh.bootstrap
    roles = sorted(m["role"] for m in status["members"])
    assert roles == ["decode", "prefill", "router"]
    for m in status["members"]:
        for field in ("role", "name", "epoch", "address", "healthy", "inflight",
                      "kv_pages_used", "kv_pages_total", "rooms", "transfer_failed_total",
                      "aborts_total", "pinned"):
            assert field in m, field
        assert m["healthy"] is True
    for m in status["members"]:
        if m["role"] != "router":
            assert m["pid"] == tiny_mesh.pid_of(m["role"]), m
            assert m["deadline_expired_total"] == 0


BAD_BODIES = [
    ("/chat/completions", b"{not json", 400),
    ("/chat/completions", {"model": "tiny", "messages": "hi"}, 400),
    ("/chat/completions", {"model": "tiny", "messages": []}, 400),
    ("/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400),
    ("/completions", {"model": "tiny", "prompt": "word " * 9000}, 400),
    ("/completions", {"model": "tiny", "prompt": 12}, 400),
]


async def test_bad_http_input_is_refused_and_disturbs_nothing(tiny_mesh):
    async with httpx.AsyncClient(base_url=tiny_mesh.base_url, timeout=60) as http:
        good_result = {}

        async def good():
            r = await http.post("/completions", json={
                "model": "tiny", "prompt": "steady", "max_tokens": 40, "temperature": 0,
            })
            good_result["r"] = r

        async with anyio.create_task_group() as tg:
            tg.start_soon(good)
            for path, body, status in BAD_BODIES:
                if isinstance(body, bytes):
                    r = await http.post(path, content=body,
                                        headers={"content-type": "application/json"})
                else:
                    r = await http.post(path, json=body)
                assert r.status_code == status, (path, body, r.text)
                error = r.json()["error"]
                assert error["message"] and error["type"]
        assert good_result["r"].status_code == 200
        assert good_result["r"].json()["usage"]["completion_tokens"] >= 1


async def test_garbage_and_out_of_order_grpc_messages_get_typed_status(tiny_mesh):
    status = await anyio.to_thread.run_sync(tiny_mesh.status)
    by_role = {m["role"]: m for m in status["members"]}
    channels = {role: open_channel(m["address"]) for role, m in by_role.items()}
    channels["bootstrap"] = open_channel(tiny_mesh.bootstrap)
    try:
        services = {
            "prefill": ["Prefill", "Admin"],
            "decode": ["Decode", "Admin"],
            "bootstrap": ["Bootstrap", "Admin"],
            "router": ["Generate", "Admin"],
        }
        descriptors = {
            "Prefill": ppb.DESCRIPTOR, "Decode": dpb.DESCRIPTOR, "Bootstrap": bpb.DESCRIPTOR,
            "Generate": gpb.DESCRIPTOR, "Admin": cpb.DESCRIPTOR,
        }
        for role, names in services.items():
            for service in names:
                for method in descriptors[service].services_by_name[service].methods:
                    path = f"/pdmesh.v1.{service}/{method.name}"
                    garbage = b"\xff\xfe garbage \x00\x01"
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        if method.server_streaming:
                            async for _ in channels[role].unary_stream(path)(garbage, timeout=5):
                                pass
                        else:
                            await channels[role].unary_unary(path)(garbage, timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path

        prefill = pgrpc.PrefillStub(channels["prefill"])
        decode = dgrpc.DecodeStub(channels["decode"])
        boot = bgrpc.BootstrapStub(channels["bootstrap"])
        key = cpb.RoomKey(room=b"r" * 16, generation=1)
        # A TransferInfo naming a decode that does not exist: refused, nothing created.
        forged = ppb.PrefillRequest(
            key=key, prompt_tokens=[1, 2, 3],
            sampling=cpb.SamplingParams(top_p=1, max_tokens=4),
            transfer=cpb.TransferInfo(key=key, decode=cpb.PeerRef(name="ghost", epoch=9),
                                      dst_pages=[0]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in prefill.Prefill(forged, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The right decode but a stale epoch: refused too.
        decode_ref = cpb.PeerRef(
            name=by_role["decode"]["name"], epoch=by_role["decode"]["epoch"] - 1
        )
        forged.transfer.decode.CopyFrom(decode_ref)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in prefill.Prefill(forged, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The right decode and epoch, but no grant from it: refused before any byte moves.
        forged.transfer.decode.epoch = by_role["decode"]["epoch"]
        forged.transfer.grant = b"\x00" * 32
        forged.transfer.grant_expires_unix_ms = 2**62
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in prefill.Prefill(forged, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A room id of the wrong size.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in decode.Generate(dpb.DecodeRequest(
                key=cpb.RoomKey(room=b"short", generation=1), prompt_tokens=3,
                sampling=cpb.SamplingParams(top_p=1, max_tokens=4),
            ), timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # An abort for a room nobody has: acknowledged, harmless.
        ack = await decode.Abort(cpb.Abort(key=key, reason="client_disconnect"), timeout=5)
        assert not ack.known and ack.released
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await decode.Abort(cpb.Abort(key=key, reason="because"), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # KeepAlive for a member never registered; for decode-0 from this client's
        # certificate (the mesh runs TLS): not its role to renew.
        for name, code in (("nobody", grpc.StatusCode.NOT_FOUND),
                           ("decode-0", grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await boot.KeepAlive(bpb.KeepAliveRequest(
                    member=cpb.PeerRef(name=name, epoch=1)), timeout=5)
            assert info.value.code() == code
        # A registration without what a decode needs.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await boot.Register(bpb.RegisterRequest(member=bpb.Member(
                role=cpb.DECODE, name="x", address="127.0.0.1:1")), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        for channel in channels.values():
            await channel.close()
    # Still serving, and nothing leaked.
    async with GenerateClient(tiny_mesh.router) as client:
        items = [i async for i in client.generate(prompt="still here", max_tokens=3)]
    assert isinstance(items[-1], Done)
    await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 2.0)


def test_openai_client_disconnect_aborts_on_every_service(tiny_mesh):
    before = {m["name"]: m["aborts_total"] for m in tiny_mesh.status()["members"]}
    with httpx.Client(base_url=tiny_mesh.base_url, timeout=30) as http:
        with http.stream("POST", "/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "go " * 300}],
            "max_tokens": 3000, "stream": True,
        }) as r:
            lines = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines += 1
                if lines >= 3:
                    break
    status = wait_quiet(tiny_mesh, 2.0)  # raises unless every member is quiet within 2 s
    after = {m["name"]: m["aborts_total"] for m in status["members"]}
    decode = [m["name"] for m in status["members"] if m["role"] == "decode"][0]
    assert after[decode] > before[decode], json.dumps(status)


async def test_every_server_serves_health_and_reflection(tiny_mesh):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    status = await anyio.to_thread.run_sync(tiny_mesh.status)
    addresses = [tiny_mesh.bootstrap] + [m["address"] for m in status["members"]]
    for address in addresses:
        channel = open_channel(address)
        try:
            check = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING, address
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in reflection_pb2_grpc.ServerReflectionStub(
                channel
            ).ServerReflectionInfo(iter([request]), timeout=5):
                names = {s.name for s in reply.list_services_response.service}
                break
            assert "grpc.health.v1.Health" in names and "pdmesh.v1.Admin" in names, names
        finally:
            await channel.close()


def test_debug_dump_shows_threads_and_tasks_of_a_live_member(tiny_mesh):
    import subprocess
    import sys

    def dump(member: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pdmesh.cli", "debug", "dump", member,
             "--bootstrap", tiny_mesh.bootstrap, "--json"],
            capture_output=True, text=True, timeout=60, env=tiny_mesh.env(),
        )

    out = dump("decode-0")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["name"] == "decode-0" and reply["pid"] > 0
    assert any("MainThread" in t["name"] for t in reply["threads"])
    stacks = "\n".join(t["stack"] for t in reply["tasks"])
    assert "_poll_notifications" in stacks and "batcher.py" in stacks  # the decode's own loops
    assert dump("bootstrap").returncode == 0
    missing = dump("nobody")
    assert missing.returncode == 1 and "no member named 'nobody'" in missing.stderr


async def test_decode_fences_its_quarantine_with_the_writer_when_no_router_does(tiny_mesh):
    """W2/W3: a decode leg ends after TransferInfo and nobody sends an Abort (the router
    vanished). The decode itself asks the prefill to fence, then frees the pages."""
    status = await anyio.to_thread.run_sync(tiny_mesh.status)
    by_role = {m["role"]: m for m in status["members"]}
    channel = open_channel(by_role["decode"]["address"])
    try:
        call = dgrpc.DecodeStub(channel).Generate(dpb.DecodeRequest(
            key=cpb.RoomKey(room=b"\x07" * 16, generation=7), prompt_tokens=40,
            sampling=cpb.SamplingParams(top_p=1, max_tokens=64),
            prefill=cpb.PeerRef(name=by_role["prefill"]["name"], epoch=by_role["prefill"]["epoch"]),
        ), timeout=30)
        first = await call.read()
        assert len(first.transfer.dst_pages) == 3
        during = await anyio.to_thread.run_sync(tiny_mesh.status)
        decode = next(m for m in during["members"] if m["role"] == "decode")
        assert decode["kv_pages_used"] == 4  # the prompt's 3 pages + 16 tokens of growth
        call.cancel()  # the "router" is gone; no Abort follows
    finally:
        await channel.close()
    await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 3.0)


async def test_a_replayed_transfer_info_moves_nothing(tiny_mesh):
    """Drive one room by hand: the decode's grant works once; replaying it is refused."""
    status = await anyio.to_thread.run_sync(tiny_mesh.status)
    by_role = {m["role"]: m for m in status["members"]}
    prefill_ref = cpb.PeerRef(name=by_role["prefill"]["name"], epoch=by_role["prefill"]["epoch"])
    key = cpb.RoomKey(room=b"\x09" * 16, generation=9)
    sampling = cpb.SamplingParams(top_p=1, max_tokens=3)
    d_channel = open_channel(by_role["decode"]["address"])
    p_channel = open_channel(by_role["prefill"]["address"])
    try:
        decode = dgrpc.DecodeStub(d_channel).Generate(dpb.DecodeRequest(
            key=key, prompt_tokens=20, sampling=sampling, prefill=prefill_ref), timeout=30)
        info = (await decode.read()).transfer
        request = ppb.PrefillRequest(key=key, prompt_tokens=list(range(100, 120)),
                                     sampling=sampling, transfer=info)
        events = [e async for e in pgrpc.PrefillStub(p_channel).Prefill(request, timeout=30)]
        assert events[-1].result.status == cpb.TRANSFER_OK
        last = None
        while (event := await decode.read()) is not grpc.aio.EOF:
            last = event
        assert last.finish.completion_tokens == 3
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pgrpc.PrefillStub(p_channel).Prefill(request, timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.ABORTED
    finally:
        await d_channel.close()
        await p_channel.close()
    await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 2.0)


async def test_a_room_whose_kv_never_comes_meets_its_deadline_and_frees_everything(tiny_mesh):
    status = await anyio.to_thread.run_sync(tiny_mesh.status)
    by_role = {m["role"]: m for m in status["members"]}
    channel = open_channel(by_role["decode"]["address"])
    started = time.monotonic()
    try:
        call = dgrpc.DecodeStub(channel).Generate(dpb.DecodeRequest(
            key=cpb.RoomKey(room=b"\x0b" * 16, generation=11), prompt_tokens=40,
            sampling=cpb.SamplingParams(top_p=1, max_tokens=8),
            prefill=cpb.PeerRef(name=by_role["prefill"]["name"], epoch=by_role["prefill"]["epoch"]),
        ), timeout=1.0)
        assert (await call.read()).HasField("transfer")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()  # no prefill ever writes: the deadline ends the room
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
    finally:
        await channel.close()
    await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 3.0)


def test_every_member_serves_its_prometheus_metrics(tiny_mesh):
    """Metrics (docs/operations.md): each prefill and decode on its own endpoint (published in
    the registry), the numbers those of `pdmesh status`, labels without request ids."""
    client = openai.OpenAI(base_url=tiny_mesh.base_url, api_key="x")
    client.completions.create(model="tiny", prompt="river engine " * 20, max_tokens=4)
    status = tiny_mesh.status()
    for m in status["members"]:
        assert m["metrics"], m
        text = httpx.get(m["metrics"], timeout=10).text
        if m["role"] == "router":
            assert "pdmesh_time_to_first_token_seconds_bucket" in text
            continue
        labels = f'name="{m["name"]}",role="{m["role"]}",service="{m["role"]}"'
        for metric in ("pdmesh_inflight_requests", "pdmesh_kv_pages_used",
                       "pdmesh_kv_pages_total", "pdmesh_transfer_failed_total",
                       "pdmesh_room_deadline_expired_total"):
            assert f"{metric}{{{labels}}}" in text, (metric, text[:2000])
        assert f'pdmesh_rooms{{{labels},state="success"}}' in text
        assert f'pdmesh_kv_pages_total{{{labels}}} {float(m["kv_pages_total"])}' in text
        if m["role"] == "prefill":
            assert _sample(text, "pdmesh_kv_transfer_seconds_count") >= 1
            assert "pdmesh_kv_transfer_bytes_bucket" in text
            assert _sample(text, "pdmesh_kv_transfer_descriptors_count") >= 1
            assert _sample(text, "pdmesh_kv_transfer_gbps_count") >= 1
        else:  # 4 tokens: a first one, then three gaps
            assert _sample(text, "pdmesh_time_to_first_token_seconds_count") >= 1
            assert _sample(text, "pdmesh_inter_token_latency_seconds_count") >= 3
            assert _sample(text, "pdmesh_decode_steps_total") >= 3
            assert _sample(text, "pdmesh_decode_step_seconds_total", 'part="compute"') > 0
        assert f'pdmesh_trace_spans_dropped_total{{cause="queue_full",{labels}}} 0.0' in text
        keys = {pair.split("=")[0] for line in text.splitlines()
                if "{" in line and not line.startswith("#")
                for pair in line[line.index("{") + 1 : line.index("}")].split(",")}
        # bounded labels only (kind: moved|skipped KV bytes; part: of a decode step);
        # never a room or a request
        assert keys <= {"name", "role", "service", "state", "reason", "cause", "kind", "le",
                        "part"}, keys
    # the bootstrap serves its own: members by role and membership changes
    text = httpx.get(status["bootstrap"]["metrics"], timeout=10).text
    boot = 'name="bootstrap",role="bootstrap",service="bootstrap"'
    assert f'pdmesh_members{{member_role="prefill",{boot}}} 1.0' in text, text[:2000]
    assert f'pdmesh_members{{member_role="decode",{boot}}} 1.0' in text
    assert _sample(text, "pdmesh_membership_events_total", 'kind="joined"') >= 3
    assert "pdmesh_trace_spans_dropped_total" in text


def _sample(text: str, metric: str, having: str = "") -> float:
    """The value of the first sample of `metric` whose labels contain `having`."""
    line = next(line for line in text.splitlines()
                if line.startswith(metric) and having in line)
    return float(line.split()[-1])
