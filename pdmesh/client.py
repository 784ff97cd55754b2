"""A small typed client for the router's public gRPC Generate API.

    async with GenerateClient("127.0.0.1:50051") as client:
        async for piece in client.generate(prompt="Hello", max_tokens=16):
            print(piece.text, end="")

Streaming and cancellable: cancelling the task that iterates (or leaving the
loop early) cancels the RPC, which aborts the request on every service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from libs.rpc.calls import open_channel, unary
from pdmesh.v1 import generate_pb2 as gpb
from pdmesh.v1 import generate_pb2_grpc as ggrpc


@dataclass
class Piece:
    """Some generated text and its token ids."""

    text: str
    token_ids: list[int]


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class GenerateClient:
    def __init__(self, address: str = "127.0.0.1:50051", timeout: float = 300.0):
        self.address = address
        self.timeout = timeout
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
        reply = await unary(self._stub.ListModels, gpb.ListModelsRequest(), timeout=10.0)
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
        )
        if seed is not None:
            request.seed = seed
        if prompt is not None:
            request.prompt = prompt
        else:
            turns = [gpb.ChatTurn(role=m["role"], content=m["content"]) for m in messages]
            request.chat.CopyFrom(gpb.ChatMessages(messages=turns))
        call = self._stub.Generate(request, timeout=self.timeout)
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "text":
                    yield Piece(event.text.text, list(event.text.token_ids))
                elif kind == "finished":
                    f = event.finished
                    yield Done(f.finish_reason, f.prompt_tokens, f.completion_tokens)
                    return
        finally:
            call.cancel()
