"""A small typed client for the router's public gRPC Generate API.

    async with GenerateClient("127.0.0.1:50051") as client:
        async for piece in client.generate(prompt="Hello", max_tokens=16):
            print(piece.text, end="")

Streaming and cancellable: cancelling the task that iterates (or leaving the
loop early) cancels the RPC, which aborts the request on every service. A router started
with --api-key wants the same key here (`api_key`, default $PDMESH_API_KEY).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from libs.rpc.calls import open_channel, unary
from pdmesh.v1 import generate_pb2 as gpb
from pdmesh.v1 import generate_pb2_grpc as ggrpc

API_KEY_ENV = "PDMESH_API_KEY"  # the router's --api-key, and every client's, by default


def api_key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The gRPC metadata that carries a router API key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


@dataclass
class TokenLogprob:
    """A generated token's log-probability and its most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Piece:
    """Some generated text and its token ids (and their logprobs, when asked)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class GenerateClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float = 300.0,
                 api_key: str | None = None):
        self.address = address
        self.timeout = timeout
        self.metadata = api_key_metadata(api_key or os.environ.get(API_KEY_ENV))
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> GenerateClient:
        self._channel = open_channel(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def _stub(self) -> ggrpc.GenerateStub:
        if self._channel is None:
            raise RuntimeError("use GenerateClient as an async context manager")
        return ggrpc.GenerateStub(self._channel)

    async def models(self) -> list[str]:
        reply = await unary(self._stub.ListModels, gpb.ListModelsRequest(), timeout=10.0,
                            metadata=self.metadata)
        return list(reply.models)

    async def generate(
        self,
        *,
        model: str = "",
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        user: str = "",
    ) -> AsyncIterator[Piece | Done]:
        """Yields Pieces then one Done; a failure raises grpc.aio.AioRpcError."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        request = gpb.GenerateRequest(
            model=model or (await self.models())[0],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop or [],
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            user=user,
        )
        if seed is not None:
            request.seed = seed
        if prompt is not None:
            request.prompt = prompt
        else:
            turns = [gpb.ChatTurn(role=m["role"], content=m["content"]) for m in messages]
            request.chat.CopyFrom(gpb.ChatMessages(messages=turns))
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self.metadata)
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "text":
                    yield Piece(event.text.text, list(event.text.token_ids), [
                        TokenLogprob(lp.token_id, lp.logprob,
                                     list(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                        for lp in event.text.logprobs
                    ])
                elif kind == "finished":
                    f = event.finished
                    yield Done(f.finish_reason, f.prompt_tokens, f.completion_tokens)
                    return
        finally:
            call.cancel()
