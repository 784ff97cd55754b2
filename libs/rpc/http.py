"""An ASGI app served by uvicorn inside our own loop and task tree.

uvicorn normally owns the process (signals, loop); here it is one task among the
service's others: the process's signal handling stays ours, and cancelling the task
asks uvicorn to stop, bounded by `stop_seconds`.
"""

from __future__ import annotations

import contextlib
import socket

import anyio
import uvicorn


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


def asgi_server(app, host: str, port: int) -> uvicorn.Server:
    return _QuietServer(
        uvicorn.Config(
            app, host=host, port=port, loop="none", lifespan="off", log_level="warning",
            timeout_graceful_shutdown=1,
        )
    )


def listen(host: str, port: int) -> socket.socket:
    """A bound socket, so the port (0: a free one) is known before uvicorn starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve_http(server: uvicorn.Server, stop_seconds: float = 5.0,
                     sock: socket.socket | None = None) -> None:
    """uvicorn stops itself once should_exit is set; cancellation only asks it to."""
    serving = anyio.CancelScope(shield=True)

    async def stop_on_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            server.should_exit = True
            # the shield ends a bounded time after the stop was asked for
            serving.deadline = anyio.current_time() + stop_seconds

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_cancel)
        with serving:
            await server.serve(sockets=[sock] if sock is not None else None)
        tg.cancel_scope.cancel()
    if not server.started:
        raise OSError("the HTTP server failed to start (is the port in use?)")
