"""Contain every handler: no message can kill a loop, every failure is a typed status.

Trap 2 of docs/design.md ("grpc.aio and anyio traps"): a handler that ends in
CancelledError sends no status and the caller hangs until its own deadline.
Internal errors become INTERNAL, typed errors keep their code, and only the
client's own cancellation passes.

Streaming handlers are written as coroutines that `await context.write(...)`
rather than async generators: a generator that yields inside a task group or
cancel scope cannot be torn down safely when the client leaves.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from libs.rpc.server import Malformed

log = logging.getLogger(__name__)


class RpcError(Exception):
    """A failure with a gRPC status code, raised by service code and sent as that status."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata  # e.g. ("retry-after", "1") on a refusal


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def contained(fn: Handler) -> Handler:
    """Turn every failure of `fn` into a gRPC status and log internal ones."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.type_name}: {request.error}"
            )
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:  # context.abort() itself: the status is already set
            raise
        except Exception as e:  # contained: the service keeps serving
            error = _first_rpc_error(e)
            if error is None:
                log.exception("handler %s failed", fn.__name__)
                error = RpcError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
            if error.trailing_metadata:
                await context.abort(error.code, error.message, error.trailing_metadata)
            await context.abort(error.code, error.message)

    return wrapper


def _first_rpc_error(e: BaseException) -> RpcError | None:
    """Find a typed error, also one raised inside a task group."""
    if isinstance(e, RpcError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            found = _first_rpc_error(inner)
            if found is not None:
                return found
    return None
