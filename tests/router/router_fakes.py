"""A fake mesh backend for the router's HTTP tests, and a handle on the server running it.

The fake is scripted by the last message (or the prompt): `key=value` pairs separated by
`;`, for example `tag=abc;tokens=5;delay=0.01`. Keys:
  tag          names the request in `FakeBackend.runs`, so a test can inspect it
  tokens       how many tokens to yield before finishing (default 3; capped by max_tokens)
  delay        seconds before each token (default 0)
  first_delay  extra seconds before the first token (default 0)
  fail_after   raise RuntimeError after this many tokens
  reject       raise RequestError(<status>) before the first token
  no_finish    end the stream without a FinishEvent
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.router.openai_schema import (
    CompletionRequest,
    FinishEvent,
    RequestError,
    TokenEvent,
)

FAKE_MODEL = "fake-model"


@dataclass
class FakeRun:
    """What the fake saw of one request, written on the server thread."""

    request: CompletionRequest
    started_at: float
    yielded: int = 0
    closed_at: float | None = None
    closed_by: str = ""  # "finished", "cancelled", "aclose" or "error"


class FakeBackend:
    def __init__(self) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.healthy = (True, "")

    def model_ids(self) -> list[str]:
        return [FAKE_MODEL]

    def is_healthy(self) -> tuple[bool, str]:
        return self.healthy

    def metrics_text(self) -> str:
        return "# TYPE pdmesh_inflight_requests gauge\npdmesh_inflight_requests 0\n"

    async def stream(self, req: CompletionRequest) -> AsyncIterator[TokenEvent | FinishEvent]:
        script = parse_script(req)
        run = FakeRun(request=req, started_at=time.monotonic())
        self.runs[script.get("tag", "")] = run
        try:
            if "reject" in script:
                raise RequestError(int(script["reject"]), "rejected by the fake", code="fake")
            await asyncio.sleep(float(script.get("first_delay", 0)))
            tokens = min(int(script.get("tokens", 3)), req.max_tokens)
            for i in range(tokens):
                await asyncio.sleep(float(script.get("delay", 0)))
                if str(i) == script.get("fail_after"):
                    raise RuntimeError("decode peer lost")
                run.yielded += 1
                yield TokenEvent(text=f" t{i}", token_id=i)
            if "no_finish" in script:
                return
            reason = "length" if tokens == req.max_tokens else "stop"
            yield FinishEvent(reason, prompt_tokens=7, completion_tokens=tokens)
            run.closed_by = "finished"
        except asyncio.CancelledError:
            run.closed_by = "cancelled"
            raise
        except GeneratorExit:
            run.closed_by = "aclose"
            raise
        except Exception:
            run.closed_by = "error"
            raise
        finally:
            run.closed_at = time.monotonic()


def parse_script(req: CompletionRequest) -> dict[str, str]:
    text = req.prompt if req.kind == "completion" else req.messages[-1].content
    pairs = (item.partition("=") for item in (text or "").split(";") if item)
    return {key.strip(): value.strip() for key, _, value in pairs}


@dataclass
class RunningServer:
    base_url: str
    port: int
    backend: FakeBackend

    def wait_closed(self, tag: str, timeout: float = 5.0) -> FakeRun:
        """The run named `tag`, once its generator has been closed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.backend.runs.get(tag)
            if run is not None and run.closed_at is not None:
                return run
            time.sleep(0.005)
        raise AssertionError(f"the fake backend's run {tag!r} was never closed")

    def wait_started(self, tag: str, timeout: float = 5.0) -> FakeRun:
        deadline = time.monotonic() + timeout
        while (run := self.backend.runs.get(tag)) is None:
            assert time.monotonic() < deadline, f"run {tag!r} never started"
            time.sleep(0.005)
        return run
