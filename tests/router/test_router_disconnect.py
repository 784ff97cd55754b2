"""A client that goes away closes the backend's generator promptly: that is the abort.

uvicorn does not cancel the app on disconnect (docs/design.md, "grpc.aio and anyio traps",
8), so these tests use raw
sockets against the real server and time how long the fake backend's generator takes to see
its `finally` after the client closed its socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
from router_fakes import FAKE_MODEL, FakeBackend, RunningServer

from services.router.openai_response import CompletionResponse
from services.router.openai_schema import parse_chat_request

ABORT_WITHIN_S = 0.2
SLOW = "tokens=1000;delay=0.05"  # 50 s of tokens if nothing aborts it


def send_request(
    port: int, path: str, body: dict[str, Any], receive_buffer: int | None = None
) -> socket.socket:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    if receive_buffer is not None:  # set before connecting, or the window is already open
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head.encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        data = sock.recv(65536)
        assert data, f"connection closed before {marker!r}; got {received!r}"
        received += data
    return received


def close_and_time_abort(sock: socket.socket, server: RunningServer, tag: str) -> float:
    closed = time.monotonic()
    sock.close()
    run = server.wait_closed(tag)
    assert run.closed_at is not None
    assert run.closed_by in {"cancelled", "aclose"}, run.closed_by
    return run.closed_at - closed


def chat_body(content: str, stream: bool) -> dict[str, Any]:
    return {
        "model": FAKE_MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": 5000,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streaming_client_disconnect_mid_stream(server: RunningServer, path: str, tag: str) -> None:
    script = f"tag={tag};{SLOW}"
    body = chat_body(script, stream=True)
    if path == "/v1/completions":
        body = {"model": FAKE_MODEL, "prompt": script, "stream": True, "max_tokens": 5000}
    sock = send_request(server.port, path, body)
    read_until(sock, b" t1")  # two tokens in: the stream is well under way
    assert close_and_time_abort(sock, server, tag) < ABORT_WITHIN_S
    assert server.backend.runs[tag].yielded < 10


def test_streaming_client_disconnect_before_first_token(server: RunningServer, tag: str) -> None:
    """Queued or prefilling: no byte has been sent yet, the abort must still reach the mesh."""
    sock = send_request(
        server.port, "/v1/chat/completions", chat_body(f"tag={tag};first_delay=30", True)
    )
    server.wait_started(tag)
    time.sleep(0.1)
    assert close_and_time_abort(sock, server, tag) < ABORT_WITHIN_S
    assert server.backend.runs[tag].yielded == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_non_streaming_client_disconnect(server: RunningServer, path: str, tag: str) -> None:
    script = f"tag={tag};{SLOW}"
    body = chat_body(script, stream=False)
    if path == "/v1/completions":
        body = {"model": FAKE_MODEL, "prompt": script, "max_tokens": 5000}
    sock = send_request(server.port, path, body)
    run = server.wait_started(tag)
    while run.yielded < 3:  # well into generating the answer nobody will read
        time.sleep(0.01)
    assert close_and_time_abort(sock, server, tag) < ABORT_WITHIN_S
    assert run.yielded < 10


def test_client_that_stops_reading_then_disconnects(server: RunningServer, tag: str) -> None:
    """A fast producer fills the socket buffers, so the response waits in send() (not in
    the backend) when the client goes away; the generator must be closed all the same."""
    body = chat_body(f"tag={tag};tokens=1000000000", stream=True)
    body["max_tokens"] = 1_000_000_000
    sock = send_request(server.port, "/v1/chat/completions", body, receive_buffer=4096)
    read_until(sock, b" t0")
    run = server.wait_started(tag)
    stalled_at = -1
    while run.yielded != stalled_at:  # wait until flow control stops the producer
        stalled_at = run.yielded
        time.sleep(0.1)
    assert close_and_time_abort(sock, server, tag) < ABORT_WITHIN_S


async def test_disconnect_while_blocked_in_send_acloses_the_backend() -> None:
    """In-process ASGI: the cancel lands in send(), with the backend parked at a yield, so
    only `aclose()` can run its cleanup. Deterministic version of the test above."""
    backend = FakeBackend()
    req = parse_chat_request(chat_body("tag=blocked;tokens=50", stream=True))
    disconnect = asyncio.Event()
    body_messages = 0

    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal body_messages
        if message["type"] == "http.response.body":
            body_messages += 1
            if body_messages == 3:  # opening chunk, " t0", then the peer stops reading
                disconnect.set()
                await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await asyncio.wait_for(CompletionResponse(backend, req)(scope, receive, send), timeout=2)
    run = backend.runs["blocked"]
    # its reader task holds the one event after " t0" that the blocked writer never took
    assert run.closed_by == "aclose" and run.yielded == 3
