"""The router's KvEvents followers (services/router/kv_watch.py) against a member that
leaves: its follower ends the moment it leaves, never calling on its closed channel."""

from __future__ import annotations

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
