"""The router's OpenAI-compatible HTTP API: routes, request decoding and error mapping.

Every failure a client can see is an OpenAI error object (`{"error": {...}}`), including
unknown routes, wrong methods and unexpected exceptions, because OpenAI clients parse that
shape to build their exceptions. The completion itself is run by `CompletionResponse`,
which owns the backend stream and the client-disconnect abort.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from http import HTTPStatus

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.router.auth import ApiKeyMiddleware
from services.router.openai_response import CompletionResponse
from services.router.openai_schema import (
    DEFAULT_LIMITS,
    CompletionBackend,
    CompletionRequest,
    RequestError,
    RequestLimits,
    error_body,
    parse_chat_request,
    parse_completion_request,
)
from services.router.openai_wire import new_completion_id

logger = logging.getLogger(__name__)

PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODELS_CREATED = int(time.time())  # OpenAI model objects carry a creation time; ours is boot


def create_app(
    backend: CompletionBackend, limits: RequestLimits = DEFAULT_LIMITS, api_key: str | None = None
) -> Starlette:
    """The ASGI app of the router's HTTP side, serving `backend`; with `api_key`, every
    route but /health and /metrics needs it (services/router/auth.py)."""
    api = OpenAIRoutes(backend, limits)
    routes = [
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.get_model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(ApiKeyMiddleware, key=api_key)] if api_key else []
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            RequestError: request_error_response,
            HTTPException: http_exception_response,
            Exception: unexpected_error_response,
        },
    )


class OpenAIRoutes:
    """Endpoint functions bound to one backend."""

    def __init__(self, backend: CompletionBackend, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        self.backend = backend
        self.limits = limits

    async def list_models(self, request: Request) -> Response:
        data = [self._model_object(model_id) for model_id in self.backend.model_ids()]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        self._require_known_model(model_id)
        return JSONResponse(self._model_object(model_id))

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(
            request, functools.partial(parse_chat_request, limits=self.limits)
        )

    async def completions(self, request: Request) -> Response:
        return await self._complete(
            request, functools.partial(parse_completion_request, limits=self.limits)
        )

    async def health(self, request: Request) -> Response:
        healthy, reason = self.backend.is_healthy()
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.backend.metrics_text(), media_type=PROMETHEUS_MEDIA_TYPE)

    async def _complete(
        self, request: Request, parse: Callable[[object], CompletionRequest]
    ) -> Response:
        # Reading the whole body here also means the disconnect watcher that CompletionResponse
        # runs on receive() sees nothing but the disconnect.
        try:
            body = await read_json(request)
        except ClientDisconnect:  # gone while sending the body: nothing started, nobody to tell
            return Response(status_code=499)
        req = parse(body)
        self._require_known_model(req.model)
        req.request_id = new_completion_id(req.kind)  # one id for the client and the mesh
        return CompletionResponse(self.backend, req)

    def _require_known_model(self, model_id: str) -> None:
        if model_id not in self.backend.model_ids():
            raise RequestError(
                404,
                f"The model '{model_id}' does not exist.",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def _model_object(model_id: str) -> dict[str, object]:
        return {"id": model_id, "object": "model", "created": MODELS_CREATED, "owned_by": "pdmesh"}


async def read_json(request: Request) -> object:
    body = await request.body()
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"The request body is not valid JSON: {exc}") from exc


async def request_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers())


async def http_exception_response(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method), as OpenAI error objects."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"No route for {request.method} {request.url.path}.", "not_found"
    elif exc.status_code == 405:
        message, code = f"Method {request.method} not allowed here.", "method_not_allowed"
    else:
        message, code = str(exc.detail), HTTPStatus(exc.status_code).phrase.lower()
    body = error_body(message, code=code.replace(" ", "_"))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def unexpected_error_response(request: Request, exc: Exception) -> Response:
    """A bug, logged by Starlette's error middleware; the client still gets an error object."""
    body = error_body("Internal server error.", type="server_error", code="internal")
    return JSONResponse(body, status_code=500)
