"""A real uvicorn server around the router's OpenAI app, serving the fake backend.

The server runs on its own thread and event loop (uvloop, as in production), so the tests
are plain synchronous code using the official `openai` client, httpx and raw sockets, and a
blocked test can never stall the server.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

# The project is not necessarily installed into the venv (plain `pytest` does not put the
# repository root on sys.path); `pythonpath = ["."]` in pyproject would make this redundant.
REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from router_fakes import FakeBackend, RunningServer  # noqa: E402

from services.router.openai_api import create_app  # noqa: E402


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    backend = FakeBackend()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(backend), loop="uvloop", lifespan="off", log_level="warning")
    uv_server = uvicorn.Server(config)
    thread = threading.Thread(target=uv_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv_server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield RunningServer(base_url=f"http://127.0.0.1:{port}", port=port, backend=backend)
    uv_server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> str:
    """A tag unique to the test, to find its run in the fake."""
    return request.node.name
