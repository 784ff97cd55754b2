"""The gRPC front end keeps reading the mesh while its client's writes wait, and writes
whatever waited as one GeneratedText: a slow client gets fewer messages than tokens, with
the same tokens, text, finish reason and usage as a fast one.

The mesh attempt is the one fake (as in test_router_closes_attempts); the handler,
MeshBackend and MeshClient above it are the router's real code.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import anyio
import pytest

from pdmesh.v1 import generate_pb2 as gpb
from services.router.backend import MeshBackend
from services.router.core import Finished, MeshClient, Tokens
from services.router.grpc_api import GenerateService
from services.router.metrics import RouterMetrics

MODEL = "fake-model"
TOKENS = 40


class Attempt:
    """A mesh attempt yielding TOKENS tokens a millisecond apart (or parking for good after
    `park_after` of them); records its cleanup."""

    def __init__(self, park_after: int | None = None) -> None:
        self.park_after = park_after
        self.cleaned_up = False

    async def __call__(self, *args):
        try:
            for i in range(TOKENS):
                if i == self.park_after:
                    await anyio.sleep(3600)
                await anyio.sleep(0.001)
                yield Tokens([100 + i], f"t{i} ")
            yield Finished("length", TOKENS)
        finally:
            # the Aborts: RPCs awaited shielded and bounded, as the real attempt does
            # (docs/design.md, "grpc.aio and anyio traps", 9), since a cancelled pump runs them
            with anyio.move_on_after(1, shield=True):
                await anyio.sleep(0.01)
                self.cleaned_up = True


class Aborted(Exception):
    pass


class Context:
    """A servicer context whose writes after GenerateStarted take `pause` seconds (a slow
    client)."""

    def __init__(self, pause: float = 0.0, fail_at: int | None = None) -> None:
        self.pause = pause
        self.fail_at = fail_at
        self.messages: list[gpb.GenerateEvent] = []

    async def write(self, message: gpb.GenerateEvent) -> None:
        if len(self.messages) == self.fail_at:
            raise ConnectionResetError("the client went away")
        self.messages.append(message)
        if message.WhichOneof("event") != "started":
            await anyio.sleep(self.pause)

    def time_remaining(self) -> None:
        return None

    async def abort(self, code, details):
        raise Aborted(code, details)


def service_with(attempt: Attempt) -> GenerateService:
    mesh = MeshClient(pairing=None)
    mesh._attempt = attempt
    tokenizer = SimpleNamespace(encode=lambda text: [7] * len(text.split()))
    backend = MeshBackend(MODEL, SimpleNamespace(max_position=128), tokenizer, mesh,
                          RouterMetrics("test"))
    return GenerateService(backend, "router")


REQUEST = gpb.GenerateRequest(model=MODEL, prompt="one two three", max_tokens=64)


async def generate(pause: float) -> list[gpb.GenerateEvent]:
    context = Context(pause)
    await service_with(Attempt()).Generate(REQUEST, context)
    return context.messages


def joined(messages: list[gpb.GenerateEvent]) -> tuple[list[int], str]:
    texts = [m.text for m in messages if m.WhichOneof("event") == "text"]
    return [t for m in texts for t in m.token_ids], "".join(m.text for m in texts)


async def test_a_slow_client_gets_fewer_messages_with_the_same_tokens_and_usage():
    fast = await generate(0.0)
    slow = await generate(0.01)
    assert joined(slow) == joined(fast)
    assert joined(fast) == ([100 + i for i in range(TOKENS)],
                            "".join(f"t{i} " for i in range(TOKENS)))
    texts = sum(m.WhichOneof("event") == "text" for m in slow)
    assert texts < TOKENS / 3
    for messages in (fast, slow):
        assert messages[0].started.prompt_tokens == 3
        assert messages[-1].finished == gpb.GenerateFinished(
            finish_reason="length", prompt_tokens=3, completion_tokens=TOKENS
        )


async def test_a_failed_write_closes_the_attempt_before_the_handler_returns():
    attempt = Attempt()
    with pytest.raises(Aborted), anyio.fail_after(5):
        await service_with(attempt).Generate(REQUEST, Context(pause=0.005, fail_at=3))
    assert attempt.cleaned_up


@pytest.mark.parametrize("pause", [0.0, 3600.0])
async def test_a_cancelled_handler_closes_the_attempt_before_it_ends(pause):
    """Cancelled while the mesh is silent (pause 0), or while its write waits on a client
    that stopped reading (3600): either way the attempt is closed before the handler ends."""
    attempt = Attempt(park_after=2)
    context = Context(pause)
    task = asyncio.get_running_loop().create_task(
        service_with(attempt).Generate(REQUEST, context)
    )
    with anyio.fail_after(5):
        while len(context.messages) < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the pump reads ahead and parks in the mesh
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert attempt.cleaned_up
