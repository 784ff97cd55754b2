"""Who may join and read the mesh, against a real TLS mesh (the default of `pdmesh up`).

Registrations without a certificate, with a certificate of another CA, or from a
certificate of another role than the one registered are refused and leave the
bootstrap's member table as it was; a client without a certificate learns no member's
NIXL metadata; a TransferInfo the decode never granted moves no byte even from a
client holding a certificate of the mesh's CA (the decode's HMAC grant); a member's cache
events go to routers only."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import grpc
import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from libs.rpc import tls
from libs.rpc.calls import unary
from libs.rpc.options import CLIENT_OPTIONS
from pdmesh.certs import issue, new_authority, role_env, write_set
from pdmesh.localmesh import free_ports, wait_quiet
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import kvevents_pb2 as kpb
from pdmesh.v1 import kvevents_pb2_grpc as kgrpc
from pdmesh.v1 import prefill_pb2 as ppb
from pdmesh.v1 import prefill_pb2_grpc as pgrpc


def mesh_config(mesh, role: str) -> tls.TlsConfig:
    """A certificate of the mesh's own set."""
    config = tls.from_env(role_env(mesh.certs, role))
    assert config is not None
    return config


def channel(address: str, config: tls.TlsConfig | None) -> grpc.aio.Channel:
    if config is None:
        return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(config),
                                   options=CLIENT_OPTIONS)


async def members(mesh) -> tuple[dict[str, int], list[bpb.Member]]:
    """name -> epoch, and the members, as a client of the mesh's CA reads them."""
    ch = channel(mesh.bootstrap, mesh_config(mesh, "client"))
    try:
        reply = await unary(bgrpc.BootstrapStub(ch).ListMembers, bpb.ListMembersRequest(),
                            timeout=10)
        return {m.name: m.epoch for m in reply.members}, list(reply.members)
    finally:
        await ch.close()


async def register(mesh, config, member: bpb.Member) -> grpc.StatusCode:
    ch = channel(mesh.bootstrap, config)
    try:
        await unary(bgrpc.BootstrapStub(ch).Register, bpb.RegisterRequest(member=member),
                    timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await ch.close()


def foreign(mesh, tmp_path, role: str, trust_ours: bool) -> tls.TlsConfig:
    """A `role` certificate of another CA; trusting the mesh's CA (so only the mesh's
    check of the client certificate can refuse it) when `trust_ours`."""
    other = new_authority()
    cert, key = issue(other, role, ["127.0.0.1"])
    ca = mesh_config(mesh, "client").ca if trust_ours else other.cert.public_bytes(Encoding.PEM)
    return tls.TlsConfig(cert_path=str(tmp_path / "foreign.pem"), cert=cert, key=key, ca=ca,
                         role=role)


async def test_only_a_certificate_of_the_role_registered_joins(tiny_mesh, tmp_path):
    before, listed = await members(tiny_mesh)
    decode = next(m for m in listed if m.role == cpb.DECODE)
    intruder = bpb.Member()
    intruder.CopyFrom(decode)  # well-formed: metadata and layout of a real decode
    intruder.name, intruder.epoch = "intruder", 0
    refusals = {
        "no certificate": (None, intruder),
        "another CA": (foreign(tiny_mesh, tmp_path, "decode", trust_ours=True), intruder),
        "a client certificate": (mesh_config(tiny_mesh, "client"), intruder),
        "a router certificate": (mesh_config(tiny_mesh, "router"), intruder),
        "a prefill certificate": (mesh_config(tiny_mesh, "prefill"), intruder),
    }
    takeover = bpb.Member()
    takeover.CopyFrom(next(m for m in listed if m.role == cpb.PREFILL))
    takeover.name = decode.name  # a prefill's certificate claiming the decode's name
    refusals["a prefill taking a decode's name"] = (mesh_config(tiny_mesh, "prefill"), takeover)
    codes = {why: await register(tiny_mesh, config, member)
             for why, (config, member) in refusals.items()}
    assert codes == {
        "no certificate": grpc.StatusCode.UNAVAILABLE,
        "another CA": grpc.StatusCode.UNAVAILABLE,
        "a client certificate": grpc.StatusCode.PERMISSION_DENIED,
        "a router certificate": grpc.StatusCode.PERMISSION_DENIED,
        "a prefill certificate": grpc.StatusCode.PERMISSION_DENIED,
        "a prefill taking a decode's name": grpc.StatusCode.PERMISSION_DENIED,
    }
    after, _ = await members(tiny_mesh)
    assert after == before  # no state: same names, same epochs
    # the check is the role, not a blanket refusal: a decode certificate registers
    decode_cert = mesh_config(tiny_mesh, "decode")
    assert await register(tiny_mesh, decode_cert, intruder) == grpc.StatusCode.OK
    ch = channel(tiny_mesh.bootstrap, mesh_config(tiny_mesh, "decode"))
    try:
        await unary(bgrpc.BootstrapStub(ch).Deregister, bpb.DeregisterRequest(
            member=cpb.PeerRef(name="intruder", epoch=(await members(tiny_mesh))[0]["intruder"])),
            timeout=5)
    finally:
        await ch.close()
    assert (await members(tiny_mesh))[0] == before


async def test_a_client_without_a_certificate_learns_no_metadata(tiny_mesh, tmp_path):
    for config in (None, foreign(tiny_mesh, tmp_path, "client", trust_ours=False)):
        ch = channel(tiny_mesh.bootstrap, config)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as listed:
                await unary(bgrpc.BootstrapStub(ch).ListMembers, bpb.ListMembersRequest(),
                            timeout=5)
            assert listed.value.code() == grpc.StatusCode.UNAVAILABLE
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as watched, anyio.fail_after(10):
                async for event in bgrpc.BootstrapStub(ch).Watch(bpb.WatchRequest(), timeout=5):
                    got.append(event)
            assert watched.value.code() == grpc.StatusCode.UNAVAILABLE and got == []
        finally:
            await ch.close()
    # while a client of the CA reads every member's metadata
    _, listed = await members(tiny_mesh)
    assert all(m.nixl_metadata for m in listed if m.role in (cpb.PREFILL, cpb.DECODE))


async def test_a_forged_transfer_info_moves_no_byte(tiny_mesh):
    _, listed = await members(tiny_mesh)
    prefill = next(m for m in listed if m.role == cpb.PREFILL)
    decode = next(m for m in listed if m.role == cpb.DECODE)
    forged = cpb.TransferInfo(key=cpb.RoomKey(room=os.urandom(16), generation=1),
                              decode=cpb.PeerRef(name=decode.name, epoch=decode.epoch),
                              dst_pages=[0, 1], grant=b"\x00" * 32)
    request = ppb.PrefillRequest(key=forged.key, prompt_tokens=list(range(5, 25)),
                                 transfer=forged, sampling=cpb.SamplingParams(top_p=1,
                                                                              max_tokens=1))
    def moved() -> int:
        return sum(m["kv_transfer_bytes_moved_total"] or 0
                   for m in tiny_mesh.status()["members"] if m["role"] == "prefill")

    moved_before = await anyio.to_thread.run_sync(moved)
    codes = {}
    client = mesh_config(tiny_mesh, "client")
    for who, config in (("no certificate", None), ("a client of the CA", client)):
        ch = channel(prefill.address, config)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pgrpc.PrefillStub(ch).Prefill(request, timeout=10):
                    pass
            codes[who] = err.value.code()
        finally:
            await ch.close()
    # TLS keeps the stranger out; the HMAC grant refuses the insider's forgery
    assert codes == {"no certificate": grpc.StatusCode.UNAVAILABLE,
                     "a client of the CA": grpc.StatusCode.PERMISSION_DENIED}
    status = await anyio.to_thread.run_sync(wait_quiet, tiny_mesh, 5.0)
    for m in status["members"]:
        if m["role"] in ("prefill", "decode"):
            assert m["rooms"] == {} and m["kv_pages_used"] == 0 and m["inflight"] == 0
    assert await anyio.to_thread.run_sync(moved) == moved_before  # not one KV byte written


def test_write_set_is_private(tmp_path):
    directory = write_set(tmp_path / "set")
    assert directory.stat().st_mode & 0o777 == 0o700
    for key in directory.glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600


def test_up_makes_a_private_set_hands_it_out_and_removes_it(tmp_path):
    """`pdmesh up` without --certs: a fresh set in a 0700 directory, the client's
    variables in its log (a client with them reads the mesh, one without cannot), and the
    directory gone once the mesh has stopped."""
    http, grpc_port, boot = free_ports(3)
    log_path = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_TLS_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "pdmesh.cli", "up", "--model", "tiny", "--http-port", str(http),
         "--grpc-port", str(grpc_port), "--bootstrap-port", str(boot)],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        env={**env, "PDMESH_PARENT_PID": str(os.getpid())})
    try:
        deadline = time.monotonic() + 120
        while "mesh ready" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        found = re.search(r"certificates in (\S+) \(removed at exit\)", log_path.read_text())
        assert found, log_path.read_text()
        directory = Path(found.group(1))
        assert directory.stat().st_mode & 0o777 == 0o700
        client = dict(re.findall(r"(PDMESH_TLS_\w+)=(\S+)", log_path.read_text()))

        def status(extra):
            return subprocess.run([sys.executable, "-m", "pdmesh.cli", "status", "--json",
                                   "--bootstrap", f"127.0.0.1:{boot}"], capture_output=True,
                                  text=True, timeout=60, env={**env, **extra})

        shown = status(client)
        assert shown.returncode == 0, shown.stderr
        assert {m["role"] for m in json.loads(shown.stdout)["members"]} >= {"prefill", "decode"}
        refused = status({})
        assert refused.returncode == 1 and "requires TLS" in refused.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert not directory.exists()


async def test_only_a_router_certificate_reads_a_members_cache_events(tiny_mesh):
    """Page keys say which prompts a member has seen: a client or a prefill of the mesh's
    own CA is refused KvEvents.Subscribe; a router's certificate gets the snapshot."""
    _, listed = await members(tiny_mesh)
    decode = next(m for m in listed if m.role == cpb.DECODE)
    outcomes = {}
    for role in ("client", "prefill", "router"):
        ch = channel(decode.address, mesh_config(tiny_mesh, role))
        try:
            call = kgrpc.KvEventsStub(ch).Subscribe(kpb.KvEventsRequest(), timeout=10)
            try:
                first = await call.read()
                outcomes[role] = (first.kind, first.member.name, first.member.epoch)
            except grpc.aio.AioRpcError as e:
                outcomes[role] = e.code()
            call.cancel()
        finally:
            await ch.close()
    assert outcomes == {"client": grpc.StatusCode.PERMISSION_DENIED,
                        "prefill": grpc.StatusCode.PERMISSION_DENIED,
                        "router": (kpb.KvCacheEvent.SNAPSHOT, decode.name, decode.epoch)}
