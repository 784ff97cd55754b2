"""Follow every paired member's KvEvents stream into the router's KvView.

One subscription per registration (endpoint): started when a prefill or decode joins,
cancelled when it leaves or is replaced by a new epoch (Pairing.on_leave cancels its
scope, before the endpoint's channel is retired and closed). A stream that ends (the member
restarts, the router fell behind, the connection drops) is opened again after a short
pause while the endpoint is still registered; each new stream begins with a SNAPSHOT, so
the view converges whatever was missed. A member that does not serve KvEvents
(UNIMPLEMENTED) simply has an empty view: pairing still works, by load alone.
"""

from __future__ import annotations

import logging

import anyio
import grpc

from pdmesh.v1 import kvevents_pb2 as kpb
from pdmesh.v1 import kvevents_pb2_grpc as kgrpc
from services.router.pairing import Endpoint, Pairing

log = logging.getLogger(__name__)

RESUBSCRIBE_SECONDS = 0.5
SCAN_SECONDS = 0.2


async def follow_members(pairing: Pairing) -> None:
    """Start a follower for each endpoint that joins; runs until cancelled."""
    async with anyio.create_task_group() as tg:
        while True:
            for endpoint in list(pairing.endpoints.values()):
                if endpoint.follower is None:
                    endpoint.follower = anyio.CancelScope()
                    tg.start_soon(_follow, pairing, endpoint)
            await anyio.sleep(SCAN_SECONDS)


async def _follow(pairing: Pairing, endpoint: Endpoint) -> None:
    name = endpoint.member.name
    stub = kgrpc.KvEventsStub(endpoint.channel)
    with endpoint.follower:  # cancelled by Pairing.on_leave
        while True:
            call = stub.Subscribe(kpb.KvEventsRequest())
            try:
                while (event := await call.read()) is not grpc.aio.EOF:
                    pairing.view.apply(name, event)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("%s serves no cache events: paired by load alone", name)
                    return
                log.debug("cache events of %s ended: %s", name, e.code().name)
            finally:
                call.cancel()
            await anyio.sleep(RESUBSCRIBE_SECONDS)
