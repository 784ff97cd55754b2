"""The router's public gRPC API: Generate (streaming) and ListModels.

Generate relays the mesh's events through `relay`: a client that reads slower than the
tokens come gets several tokens in one GeneratedText (with their logprobs, when asked).
With the router's --api-key both need `authorization: Bearer KEY` metadata; Admin stays
open, as on every member.
"""

from __future__ import annotations

import functools
import secrets

import grpc

from libs.member.timeouts import TIMEOUTS
from libs.rpc.dump import dump
from libs.rpc.handlers import RpcError, contained, invalid
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import common_pb2_grpc as cgrpc
from pdmesh.v1 import generate_pb2 as gpb
from pdmesh.v1 import generate_pb2_grpc as ggrpc
from services.router.auth import check_grpc
from services.router.backend import MeshBackend, operation_of
from services.router.core import Finished, MeshError, Tokens
from services.router.openai_schema import (
    DEFAULT_LIMITS,
    ChatMessage,
    CompletionRequest,
    RequestError,
    RequestLimits,
)
from services.router.relay import relay

DEFAULT_MAX_TOKENS = 256

_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def to_completion_request(
    request: gpb.GenerateRequest, limits: RequestLimits = DEFAULT_LIMITS
) -> CompletionRequest:
    """Validate a GenerateRequest into the same request type the HTTP side uses."""
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("one of prompt or chat is required")
    if which == "chat":
        if not request.chat.messages:
            raise invalid("chat.messages must not be empty")
        messages = [ChatMessage(m.role, m.content) for m in request.chat.messages]
        for m in messages:
            if m.role not in ("system", "user", "assistant", "tool"):
                raise invalid(f"unknown chat role {m.role!r}")
    if not 0.0 <= request.temperature <= 2.0:
        raise invalid("temperature must be in [0, 2]")
    if not 0.0 <= request.top_p <= 1.0:
        raise invalid("top_p must be in (0, 1]")
    if request.top_logprobs > limits.max_top_logprobs:
        raise invalid(f"top_logprobs must be at most {limits.max_top_logprobs}")
    if request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs needs logprobs")
    return CompletionRequest(
        kind="chat" if which == "chat" else "completion",
        model=request.model,
        messages=messages if which == "chat" else None,
        prompt=request.prompt if which == "prompt" else None,
        max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=request.temperature,
        top_p=request.top_p or 1.0,
        top_k=request.top_k,
        seed=request.seed if request.HasField("seed") else None,
        stop=list(request.stop),
        stream=True,
        include_usage=True,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        user=request.user or None,
    )


def _retry_after(seconds: int | None) -> tuple[tuple[str, str], ...]:
    """A refusal's Retry-After as trailing metadata, the HTTP header's gRPC twin."""
    return () if seconds is None else (("retry-after", str(seconds)),)


async def _write(context, prompt_tokens: int, events: list[Tokens | Finished]) -> None:
    """Every token that waited in one GeneratedText, then the GenerateFinished if it came."""
    tokens = [e for e in events if isinstance(e, Tokens)]
    if tokens:
        text = gpb.GeneratedText(token_ids=[t for e in tokens for t in e.token_ids],
                                 text="".join(e.text for e in tokens),
                                 logprobs=[lp for e in tokens for lp in e.logprobs])
        await context.write(gpb.GenerateEvent(text=text))
    for event in events:
        if isinstance(event, Finished):
            done = gpb.GenerateFinished(
                finish_reason=event.finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=event.completion_tokens,
            )
            await context.write(gpb.GenerateEvent(finished=done))


class GenerateService(ggrpc.GenerateServicer, cgrpc.AdminServicer):
    def __init__(self, backend: MeshBackend, name: str,
                 limits: RequestLimits = DEFAULT_LIMITS, api_key: str | None = None):
        self.backend = backend
        self.name = name
        self.limits = limits
        self.api_key = api_key

    @contained
    async def Generate(self, request, context):
        check_grpc(context, self.api_key)
        req = to_completion_request(request, self.limits)
        try:
            if req.model not in self.backend.model_ids():
                raise RequestError(404, f"model {req.model!r} does not exist")
            prompt = self.backend.prompt_tokens(req)
            if not prompt:
                raise RequestError(400, "the prompt is empty")
            sampling = self.backend.sampling(req, len(prompt))
            await context.write(
                gpb.GenerateEvent(
                    started=gpb.GenerateStarted(
                        request_id=f"gen-{secrets.token_hex(8)}", prompt_tokens=len(prompt)
                    )
                )
            )
            # The legs end a little before the caller's own deadline, so the request fails
            # as `deadline` with a typed status instead of racing the caller's cancellation.
            remaining = context.time_remaining()
            budget = None if remaining is None else TIMEOUTS.leg_budget(remaining)
            await relay(lambda: self.backend.run(prompt, sampling, operation_of(req), budget,
                                                 user=req.user),
                        functools.partial(_write, context, len(prompt)))
        except RequestError as e:
            # The mesh's own code when it has one (OUT_OF_RANGE is a 400 on HTTP, say).
            cause = e.__cause__
            code = (cause.code if isinstance(cause, MeshError)
                    else _HTTP_TO_GRPC.get(e.status, grpc.StatusCode.INTERNAL))
            raise RpcError(code, e.message, _retry_after(e.retry_after)) from e
        except MeshError as e:
            raise RpcError(e.code, str(e), _retry_after(e.retry_after)) from e

    @contained
    async def ListModels(self, request, context):
        check_grpc(context, self.api_key)
        return gpb.ListModelsReply(models=self.backend.model_ids())

    @contained
    async def Dump(self, request, context):
        return dump(self.name)

    @contained
    async def Stats(self, request, context):
        return cpb.MemberStats(
            role=cpb.ROUTER,
            name=self.name,
            healthy=self.backend.is_healthy()[0],
            inflight=self.backend.inflight,
            aborts_total=sum(self.backend.mesh.aborts.values()),
            queue_depth=self.backend.mesh.queue.depth,
        )
