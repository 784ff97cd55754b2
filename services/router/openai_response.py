"""The ASGI response that runs one completion on the backend and writes it out.

Why a response of our own rather than StreamingResponse/JSONResponse:
- uvicorn never cancels the app when a client disconnects (docs/design.md, trap 8). Starlette's
  StreamingResponse watches for it only while the server announces ASGI < 2.4, and
  JSONResponse never does. Here one watcher covers every phase (waiting for the first token,
  streaming, collecting a non-streaming answer), so a client that goes away aborts the request
  on every service promptly, whatever the server announces.
- The status line waits for the backend's first event, so a RequestError raised before it
  (prompt too long, mesh unavailable...) is still a proper 4xx/5xx error object.
- The backend generator is opened in exactly one place, inside `aclosing`, so it is closed
  on every path: finished, failed, or cancelled by the disconnect watcher.
- A request's n choices come from `choice_events` (choices.py) as (index, event) in
  arrival order; n = 1 takes the same path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from services.router.choices import Events, choice_events, next_event
from services.router.openai_schema import (
    CompletionBackend,
    CompletionRequest,
    FinishEvent,
    RequestError,
    TokenEvent,
    TokenLogprob,
)
from services.router.openai_wire import ChoiceOutput, CompletionWire
from services.router.sse import SSE_DONE, SSE_MEDIA_TYPE, sse_event

logger = logging.getLogger(__name__)



class ResponseFailed(Exception):
    """The client was sent an error: what the other choices would produce is not needed."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone away (the request body must be consumed already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work`, cancelling it as soon as the client disconnects.

    Returns True when the client went away before `work` finished. Exceptions of `work`
    propagate unwrapped (not as an ExceptionGroup), so callers can catch them as usual.
    """
    completed = False
    failure: Exception | None = None
    async with anyio.create_task_group() as task_group:

        async def cancel_on_disconnect() -> None:
            await wait_for_disconnect(receive)
            task_group.cancel_scope.cancel()

        task_group.start_soon(cancel_on_disconnect)
        try:
            await work()
            completed = True
        except Exception as exc:
            failure = exc
        task_group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return not completed


def server_error(exc: BaseException) -> RequestError:
    """What the client sees of an unexpected backend failure."""
    if isinstance(exc, RequestError):
        return exc
    error = RequestError(500, f"Generation failed: {exc}", type="server_error", code="internal")
    error.__cause__ = exc
    return error


class CompletionResponse(Response):
    """One completion, streamed as SSE or returned as one JSON object per `req.stream`."""

    def __init__(self, backend: CompletionBackend, req: CompletionRequest) -> None:
        self.backend = backend
        self.req = req
        self.wire = CompletionWire.for_request(req)
        self.echo_pending = set(range(req.n)) if req.echo else set()  # choices not yet echoed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def respond() -> None:
            try:
                async with choice_events(self.backend, self.req) as events:
                    if self.req.stream:
                        await self._stream(events, scope, receive, send)
                    else:
                        await self._collect(events, scope, receive, send)
            except ResponseFailed:  # the client has its error: the other choices are closed
                pass

        try:
            if await run_until_disconnect(receive, respond):
                logger.info("client disconnected; request %s aborted", self.wire.id)
        except OSError:  # a server announcing ASGI 2.4 raises it on send after a disconnect
            logger.info("client disconnected; request %s aborted", self.wire.id)

    async def _collect(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        n = self.req.n
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob] | None] = [
            [] if self.req.logprobs else None for _ in range(n)
        ]
        finishes: dict[int, FinishEvent] = {}
        try:
            while len(finishes) < n:
                index, event = await next_event(events)
                if isinstance(event, FinishEvent):
                    finishes[index] = event
                    continue
                text, entries = self._echoed(index, event)
                texts[index].append(text)
                if entries is not None and logprobs[index] is not None:
                    logprobs[index].extend(entries)
        except Exception as exc:
            await self._send_error(server_error(exc), scope, receive, send)
            raise ResponseFailed() from exc
        choices = [ChoiceOutput("".join(texts[i]), finishes[i], logprobs[i]) for i in range(n)]
        body = self.wire.full_response(choices)
        await JSONResponse(body, headers={"x-request-id": self.wire.id})(scope, receive, send)

    async def _stream(self, events: Events, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            index, event = await next_event(events)
        except Exception as exc:
            await self._send_error(server_error(exc), scope, receive, send)
            raise ResponseFailed() from exc

        await self._start_event_stream(send)
        for chunk in self.wire.opening_chunks(self.req.n):
            await self._send_body(send, sse_event(chunk))
        finishes: list[FinishEvent] = []
        try:
            while True:
                if isinstance(event, FinishEvent):
                    finishes.append(event)
                    chunk = self.wire.finish_chunk(event.finish_reason, index)
                    await self._send_body(send, sse_event(chunk))
                    if len(finishes) == self.req.n:
                        break
                else:
                    text, entries = self._echoed(index, event)
                    chunk = self.wire.token_chunk(text, index, entries)
                    await self._send_body(send, sse_event(chunk))
                index, event = await next_event(events)
        except Exception as exc:
            await self._send_stream_error(send, exc)
            raise ResponseFailed() from exc
        if self.req.include_usage:
            await self._send_body(send, sse_event(self.wire.usage_chunk(finishes)))
        await self._send_body(send, SSE_DONE, more_body=False)

    def _echoed(self, index: int, event: TokenEvent) -> tuple[str, list[TokenLogprob] | None]:
        """An event's text and logprobs, the prompt's leading them on a choice's first
        event when the request echoes it."""
        if index not in self.echo_pending:
            return event.text, event.logprobs
        self.echo_pending.discard(index)
        text = (self.req.prompt or "") + event.text
        if event.logprobs is None:
            return text, None
        return text, [*(event.prompt_logprobs or []), *event.logprobs]

    async def _start_event_stream(self, send: Send) -> None:
        headers = {
            "content-type": f"{SSE_MEDIA_TYPE}; charset=utf-8",
            "cache-control": "no-cache",
            "x-accel-buffering": "no",  # proxies must not buffer tokens
            "x-request-id": self.wire.id,
        }
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})

    async def _send_stream_error(self, send: Send, exc: Exception) -> None:
        """After the 200 went out, a failure is an error event then [DONE], never a finish."""
        logger.warning("request %s failed mid-stream: %r", self.wire.id, exc, exc_info=exc)
        await self._send_body(send, sse_event(server_error(exc).to_body()))
        await self._send_body(send, SSE_DONE, more_body=False)

    async def _send_error(
        self, error: RequestError, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Before the status line: the error object with the error's own status."""
        if error.status >= 500:
            cause = error.__cause__ or error
            logger.error("request %s failed: %r", self.wire.id, cause, exc_info=cause)
        response = JSONResponse(
            error.to_body(), status_code=error.status,
            headers={"x-request-id": self.wire.id, **error.headers()},
        )
        await response(scope, receive, send)

    @staticmethod
    async def _send_body(send: Send, body: bytes, more_body: bool = True) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more_body})
