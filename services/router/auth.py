"""The router's API key (`pdmesh router --api-key`): who may call the public API.

HTTP clients send `Authorization: Bearer KEY` (what the official OpenAI clients send for
their `api_key`), gRPC clients the same value as `authorization` metadata. A missing or
wrong key is 401 in the OpenAI error shape on HTTP and UNAUTHENTICATED on gRPC, answered
before the request body is read: it reaches nothing behind the router. `/health` and
`/metrics` stay open for probes and scrapers, as do every member's Admin, health and
reflection services, which are the operator's, not the API's. Keys are compared in
constant time, so the time to refuse says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from libs.rpc.handlers import RpcError
from services.router.openai_schema import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


def refusal(authorization: str | None, key: str) -> tuple[str, str] | None:
    """None when `authorization` carries `key`, else (code, message) saying why not."""
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return "missing_api_key", "Missing API key: send it as 'Authorization: Bearer KEY'."
    if not hmac.compare_digest(presented.strip().encode(), key.encode()):
        return "invalid_api_key", "Incorrect API key provided."
    return None


class ApiKeyMiddleware:
    """ASGI middleware: every HTTP route but OPEN_PATHS needs the key."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            why = refusal(header.decode("latin-1"), self.key)
            if why is not None:
                code, message = why
                response = JSONResponse(error_body(message, code=code), status_code=401,
                                        headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_grpc(context: grpc.aio.ServicerContext, key: str | None) -> None:
    """Raise UNAUTHENTICATED unless the call's `authorization` metadata carries `key`."""
    if key is None:
        return
    metadata = dict(context.invocation_metadata() or ())
    why = refusal(metadata.get("authorization"), key)
    if why is not None:
        raise RpcError(grpc.StatusCode.UNAUTHENTICATED, why[1])
