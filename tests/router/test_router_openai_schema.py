"""Parsing defaults and the wire objects, without a server."""

from __future__ import annotations

import pytest

from services.router.openai_schema import (
    DEFAULT_MAX_TOKENS,
    ChatMessage,
    FinishEvent,
    RequestError,
    parse_chat_request,
    parse_completion_request,
)
from services.router.openai_wire import CompletionWire
from services.router.sse import SSE_DONE, sse_event


def test_chat_defaults() -> None:
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.kind == "chat" and req.prompt is None
    assert req.messages == [ChatMessage("user", "hi")]
    assert req.max_tokens == DEFAULT_MAX_TOKENS and req.temperature == 1.0 and req.top_p == 1.0
    assert req.seed is None and req.stop == [] and req.n == 1
    assert not req.stream and not req.include_usage


def test_completion_fields() -> None:
    req = parse_completion_request(
        {
            "model": "m",
            "prompt": "once",
            "max_tokens": 3,
            "temperature": 0,
            "top_p": 0.9,
            "seed": 11,
            "stop": ["\n", ""],
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": None,
            "user": "someone",
        }
    )
    assert (req.kind, req.prompt, req.max_tokens, req.temperature) == ("completion", "once", 3, 0)
    assert (req.top_p, req.seed, req.stop) == (0.9, 11, ["\n"])
    assert req.stream and req.include_usage


def test_top_k_is_accepted_as_an_extension() -> None:
    assert parse_completion_request({"model": "m", "prompt": "p"}).top_k == 0
    assert parse_completion_request({"model": "m", "prompt": "p", "top_k": 40}).top_k == 40
    for bad in (-1, 2.5, "4"):
        with pytest.raises(RequestError) as caught:
            parse_completion_request({"model": "m", "prompt": "p", "top_k": bad})
        assert (caught.value.status, caught.value.param) == (400, "top_k")


@pytest.mark.parametrize("value", [True, 2.0, "5", [5]])
def test_max_tokens_must_be_an_integer(value: object) -> None:
    with pytest.raises(RequestError) as caught:
        parse_completion_request({"model": "m", "prompt": "p", "max_tokens": value})
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")


def test_request_error_body() -> None:
    error = RequestError(404, "gone", param="model", code="model_not_found")
    assert error.to_body() == {
        "error": {
            "message": "gone",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_sse_framing() -> None:
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_wire_shares_id_and_created() -> None:
    req = parse_chat_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    wire = CompletionWire.for_request(req)
    finish = FinishEvent("stop", prompt_tokens=2, completion_tokens=1)
    chunks = [*wire.opening_chunks(), wire.token_chunk("x"), wire.finish_chunk("stop")]
    chunks.append(wire.usage_chunk([finish]))
    assert {(c["id"], c["created"], c["object"]) for c in chunks} == {
        (wire.id, wire.created, "chat.completion.chunk")
    }
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 3
