"""A request's n choices (OpenAI's `n`) as one stream of events.

Each choice is a request of its own through the backend (its own prompt KV on its own
pair: a prefill's KV goes to one decode), read by a task of its own into one queue of
(index, event) that the response writes in arrival order. Choice i samples with a seed
derived from the request's (`choice_seed`), so a seeded request's choices are
reproducible, and choice 0 is what the same request with n = 1 returns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from contextlib import aclosing, asynccontextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from services.router.openai_schema import (
    CompletionBackend,
    CompletionRequest,
    FinishEvent,
    TokenEvent,
)

logger = logging.getLogger(__name__)

Event = TokenEvent | FinishEvent
Events = MemoryObjectReceiveStream[tuple[int, Event | Exception]]


class BackendEndedEarly(Exception):
    """The backend's stream ended without a FinishEvent: a failure, never a "length"."""

    def __init__(self) -> None:
        super().__init__("the generation ended without a finish event")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` samples with: the request's own for choice 0, a hash of
    (seed, index) for the others; None (a fresh random seed per choice) when unseeded."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits, as the router's own seeds


@asynccontextmanager
async def choice_events(backend: CompletionBackend, req: CompletionRequest):
    """The events of the request's n choices as (index, event) in arrival order; a
    choice's failure arrives as (index, exception) and ends nothing else by itself.

    Leaving the block normally waits for every choice's stream to end on its own (its
    FinishEvent is not its end: closing it there would count a served request as an
    abort); leaving it by an exception (the client gone, a failure) closes them all.
    """
    # Unbuffered: a choice's reader holds at most the one event the writer has not taken,
    # so a client that reads slowly holds its backend streams back (flow control).
    # The readers are cancelled (their streams closed: Aborts) when the block raises, or
    # when it is cancelled (the client went away).
    send, receive = anyio.create_memory_object_stream[tuple[int, Event | Exception]](0)
    failure: Exception | None = None
    async with receive, anyio.create_task_group() as tg:
        for index in range(req.n):
            choice = dataclasses.replace(req, seed=choice_seed(req.seed, index))
            tg.start_soon(_read_choice, backend, choice, index, send.clone())
        send.close()
        try:
            yield receive
        except Exception as exc:  # raised below, unwrapped (not as an ExceptionGroup)
            failure = exc
            tg.cancel_scope.cancel()
        else:
            async for index, extra in receive:
                logger.warning("request %s: choice %d yielded %r after finishing",
                               req.request_id, index, extra)
    if failure is not None:
        raise failure


async def _read_choice(backend: CompletionBackend, req: CompletionRequest, index: int,
                       send: MemoryObjectSendStream[tuple[int, Event | Exception]]) -> None:
    async with send:
        try:
            async with aclosing(backend.stream(req)) as events:
                async for event in events:
                    await send.send((index, event))
        except Exception as exc:  # the reader raises it, after what came before
            await send.send((index, exc))


async def next_event(events: Events) -> tuple[int, Event]:
    """The next choice's event; a choice's failure is raised here."""
    try:
        index, event = await events.receive()
    except anyio.EndOfStream:
        raise BackendEndedEarly() from None
    if isinstance(event, Exception):
        raise event
    return index, event


