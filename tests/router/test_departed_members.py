"""A member that leaves the mesh has its channel retired and closed by the router: nothing
of the router may call it after that. Its KvEvents follower (services/router/kv_watch.py)
ends the moment it leaves, and a request whose pair lost it sends it no Abort."""

from __future__ import annotations

import asyncio

import anyio
import grpc

from pdmesh.localmesh import free_port
from pdmesh.v1 import common_pb2 as cpb
from services.router import kv_watch
from services.router.pairing import Pairing
from tests.router.test_kv_routing import member


async def test_a_leaving_members_follower_stops_before_its_channel_closes(monkeypatch):
    """The member's address refuses connections, so its follower fails to subscribe and
    waits to try again. The member leaves and its channel is closed at once, as the
    router's retired-channel loop may do; the next scan for departed members is far off.
    The follower must already be gone: a Subscribe on a closed channel raises
    grpc's UsageError, which would end follow_members and with it the router."""
    monkeypatch.setattr(kv_watch, "SCAN_SECONDS", 60.0)
    monkeypatch.setattr(kv_watch, "RESUBSCRIBE_SECONDS", 0.05)
    pairing = Pairing()
    decode = member(cpb.DECODE, "decode-0", free_port())
    pairing.on_join(decode)
    endpoint = pairing.endpoints["decode-0"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(kv_watch.follow_members, pairing)
        await anyio.sleep(0.3)  # several refused subscriptions
        assert endpoint.follower is not None and not endpoint.follower.cancel_called
        pairing.on_leave(decode, "lease expired")
        assert endpoint.follower.cancel_called
        for channel in pairing.retired:
            await channel.close()
        await anyio.sleep(0.3)  # several resubscribe periods: none may call the closed channel
        tg.cancel_scope.cancel()
    assert endpoint.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN


class _RecordingStub:
    """Stands in for a member's stub: records Abort calls, answers at once (a finished
    future is all libs.rpc.calls.unary needs of a call)."""

    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def Abort(self, request, timeout=None, metadata=None):  # noqa: N802 (the RPC's name)
        self.calls.append(self.name)
        done = asyncio.get_running_loop().create_future()
        done.set_result(cpb.AbortAck(released=True))
        return done


async def test_a_request_never_calls_a_member_of_its_pair_that_left():
    """Both members of a request's pair left (each one's channel retired): the request's
    aborts call neither; with only the prefill gone, only the decode is told."""
    from services.router.core import Progress, _Legs
    from services.router.pairing import Endpoint, Pair

    def legs(calls: list[str]) -> _Legs:
        ends = [Endpoint(member(role, name, 1), channel=None,
                         stub=_RecordingStub(calls, name))
                for role, name in ((cpb.PREFILL, "prefill-0"), (cpb.DECODE, "decode-0"))]
        return _Legs(Pair(*ends), cpb.RoomKey(room=b"\x01" * 16, generation=1), Progress(),
                     reserved=lambda: None, prefill_freed=lambda: None)

    calls: list[str] = []
    both = legs(calls)
    both.lose("prefill-0", "lease expired")
    both.lose("decode-0", "lease expired")
    await both._send_aborts("client gone")
    assert calls == []
    one = legs(calls)
    one.lose("prefill-0", "lease expired")
    await one._send_aborts("client gone")
    assert calls == ["decode-0"]
