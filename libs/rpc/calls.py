"""Calls that stay correct under anyio cancellation.

Trap 1 of docs/design.md ("grpc.aio and anyio traps"):
`with anyio.move_on_after(t): await stub.Unary(req)` lets a bare CancelledError
escape and kill the enclosing task, because grpc replaces anyio's cancellation
with one that anyio does not recognise. The working pattern: start the call,
wait on an anyio.Event set by the call's done callback, cancel the call if that
wait is interrupted, then read the result.
"""

from __future__ import annotations

from typing import Any

import anyio
import grpc

from libs.rpc import tls
from libs.rpc.options import CLIENT_OPTIONS


def open_channel(address: str) -> grpc.aio.Channel:
    """A channel with pdmesh's keepalives, mutual TLS when this process has a certificate
    (libs.rpc.tls); create it inside the running loop."""
    config = tls.client_config()
    if config is None:
        return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(config),
                                   options=CLIENT_OPTIONS)


async def close_channel(channel: grpc.aio.Channel, seconds: float = 1.0) -> None:
    """Close a channel from a finally block: shielded (the scope may be cancelled) and
    bounded (docs/design.md, trap 9)."""
    with anyio.move_on_after(seconds, shield=True):
        await channel.close()


async def unary(method: Any, request: Any, *, timeout: float, metadata=None) -> Any:
    """Call a unary-unary method; anyio cancellation cancels the RPC cleanly."""
    call = method(request, timeout=timeout, metadata=metadata)
    done = anyio.Event()
    call.add_done_callback(lambda _call: done.set())
    try:
        await done.wait()
    except BaseException:
        call.cancel()
        raise
    return await call
