"""A caller that leaves while the router's generators sit at a `yield` must close the whole
chain down to the mesh attempt in its own task, before `aclose()` returns.

The chain is grpc_api/openai_response -> MeshBackend.run/stream -> _run ->
MeshClient.generate -> _attempt, whose `finally` sends the Aborts and cancels both legs.
When the cancellation lands outside the chain (the handler awaiting `context.write` or
the HTTP `send`), only `aclose()` reaches the attempt; a bare `async for` anywhere in the
chain leaves it to the garbage collector's finalizer: a detached task, run late or, for
an object caught in a reference cycle, not until a full collection. docs/incidents.md
("A cascade storm never quiesced") has the failure this guards against, and what it does
not explain.

The mesh attempt is the one fake here: an async generator whose cleanup awaits, as the
Aborts do. Everything above it is the router's real code.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import anyio
import pytest

from pdmesh.v1 import common_pb2 as cpb
from services.router.backend import MeshBackend
from services.router.core import MeshClient, Tokens
from services.router.metrics import RouterMetrics
from services.router.openai_schema import CompletionRequest

MODEL = "fake-model"


class Cleanups:
    """The fake attempt: two tokens, then parked; records the task its cleanup ran in."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task | None] = []

    async def attempt(self, *args):
        try:
            yield Tokens([1], "a")
            yield Tokens([2], "b")
            await anyio.sleep(3600)
        finally:
            await anyio.sleep(0.01)  # the Aborts are RPCs: cleanup that awaits
            self.tasks.append(asyncio.current_task())


def backend_with(cleanups: Cleanups) -> MeshBackend:
    mesh = MeshClient(pairing=None)
    mesh._attempt = cleanups.attempt
    tokenizer = SimpleNamespace(encode=lambda text: [7] * len(text.split()))
    config = SimpleNamespace(max_position=128)
    return MeshBackend(MODEL, config, tokenizer, mesh, RouterMetrics("test"))


def completion_request() -> CompletionRequest:
    return CompletionRequest(
        kind="completion", model=MODEL, messages=None, prompt="one two three", max_tokens=8,
        temperature=0.0, top_p=1.0, seed=1, stop=[], stream=True, include_usage=False,
    )


async def test_mesh_client_generate_closes_its_attempt_inside_aclose():
    cleanups = Cleanups()
    mesh = MeshClient(pairing=None)
    mesh._attempt = cleanups.attempt
    events = mesh.generate([1, 2, 3], cpb.SamplingParams(max_tokens=8))
    assert isinstance(await events.__anext__(), Tokens)
    await events.aclose()
    assert cleanups.tasks == [asyncio.current_task()]


@pytest.mark.parametrize("path", ["grpc", "http"])
async def test_backend_closes_the_attempt_inside_aclose(path):
    """The gRPC front end reads `backend.run`, the HTTP one `backend.stream`."""
    cleanups = Cleanups()
    backend = backend_with(cleanups)
    if path == "grpc":
        events = backend.run([1, 2, 3], cpb.SamplingParams(max_tokens=8))
    else:
        events = backend.stream(completion_request())
    first = await events.__anext__()
    assert first.text == "a" and (path == "http" or isinstance(first, Tokens))
    await events.aclose()
    assert cleanups.tasks == [asyncio.current_task()]
    assert backend.inflight == 0


async def test_a_handler_cancelled_at_its_own_await_still_aborts_in_its_task():
    """The incident's case: the handler is cancelled while awaiting its own write, not the
    mesh."""
    cleanups = Cleanups()
    backend = backend_with(cleanups)
    parked = anyio.Event()

    async def handler() -> None:
        from contextlib import aclosing

        async with aclosing(backend.run([1, 2, 3], cpb.SamplingParams(max_tokens=8))) as ev:
            async for _ in ev:
                parked.set()
                await anyio.sleep(3600)  # stands for `await context.write(...)`

    task = asyncio.get_running_loop().create_task(handler())
    await parked.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert cleanups.tasks == [task]
