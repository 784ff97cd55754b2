"""Process entry for a service: uvloop, logging, and a clean stop on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable

import anyio

log = logging.getLogger(__name__)


def setup_logging(service: str) -> None:
    level = os.environ.get("PDMESH_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


async def _until_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            scope.cancel()
            return


def run_service(service: str, main: Callable[[], Awaitable[None]]) -> int:
    """Run `main` on a uvloop event loop until it returns or a stop signal arrives.

    `main` owns the service's whole task tree; a signal cancels it, and its own
    finally blocks release what it holds (deregister, stop the server).
    """
    setup_logging(service)
    provider = None
    if service != "up":  # the supervisor serves no requests: nothing to trace
        from libs.tracing import configure

        provider = configure(f"pdmesh-{service}")

    async def root() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_until_signal, tg.cancel_scope)
            await main()
            tg.cancel_scope.cancel()

    try:
        anyio.run(root, backend="asyncio", backend_options={"use_uvloop": _have_uvloop()})
    except BaseExceptionGroup as group:
        # A startup refusal (SystemExit with one line) exits with that line, not a trace.
        exits, rest = group.split(SystemExit)
        if exits is None or rest is not None:
            raise
        raise _first_leaf(exits) from None
    finally:
        if provider is not None:
            provider.shutdown()  # flushes what is queued, bounded by the export timeout
    return 0


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _have_uvloop() -> bool:
    """uvloop when installed (always, via pyproject); plain asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        log.warning("uvloop not installed: running on the plain asyncio loop")
        return False
    return True
