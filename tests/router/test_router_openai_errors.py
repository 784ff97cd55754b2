"""Every failure reaches the client as an OpenAI error object, with the right status."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from router_fakes import FAKE_MODEL, RunningServer

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def chat(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


def text(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": FAKE_MODEL, "prompt": "hi"}
    body.update(overrides)
    return body


def assert_error_object(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def sse_payloads(body: str) -> list[Any]:
    """The data of each SSE event; "[DONE]" stays a string."""
    assert body.endswith("\n\n")
    payloads = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


BAD_REQUESTS = [
    pytest.param(CHAT, chat(max_tokens="abc"), "max_tokens", id="max_tokens-string"),
    pytest.param(CHAT, chat(max_tokens=0), "max_tokens", id="max_tokens-zero"),
    pytest.param(TEXT, text(max_tokens=-3), "max_tokens", id="text-max_tokens-negative"),
    pytest.param(TEXT, text(max_tokens=1.5), "max_tokens", id="max_tokens-float"),
    pytest.param(
        CHAT, chat(max_completion_tokens=0), "max_completion_tokens", id="max_completion_tokens"
    ),
    pytest.param(CHAT, chat(messages="hi"), "messages", id="messages-not-list"),
    pytest.param(CHAT, chat(messages=[]), "messages", id="messages-empty"),
    pytest.param(CHAT, {"model": FAKE_MODEL}, "messages", id="messages-missing"),
    pytest.param(CHAT, chat(messages=["hi"]), "messages[0]", id="message-not-object"),
    pytest.param(
        CHAT, chat(messages=[{"role": "user"}]), "messages[0].content", id="content-missing"
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        "messages[0].content",
        id="content-number",
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0]",
        id="content-image-part",
    ),
    pytest.param(CHAT, chat(messages=[{"content": "hi"}]), "messages[0].role", id="role-missing"),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        "messages[0].role",
        id="role-unknown",
    ),
    pytest.param(CHAT, chat(temperature=2.5), "temperature", id="temperature-high"),
    pytest.param(CHAT, chat(temperature=-0.1), "temperature", id="temperature-negative"),
    pytest.param(TEXT, text(temperature="hot"), "temperature", id="temperature-string"),
    pytest.param(CHAT, chat(top_p=0), "top_p", id="top_p-zero"),
    pytest.param(TEXT, text(top_p=1.01), "top_p", id="top_p-high"),
    pytest.param(CHAT, chat(n=0), "n", id="n-zero"),
    pytest.param(CHAT, chat(n=9), "n", id="n-over-the-bound"),
    pytest.param(TEXT, text(n="3"), "n", id="n-string"),
    pytest.param(CHAT, chat(logprobs="yes"), "logprobs", id="logprobs-string"),
    pytest.param(CHAT, chat(logprobs=1), "logprobs", id="chat-logprobs-number"),
    pytest.param(TEXT, text(logprobs="yes"), "logprobs", id="text-logprobs-string"),
    pytest.param(TEXT, text(logprobs=True), "logprobs", id="text-logprobs-bool"),
    pytest.param(TEXT, text(logprobs=21), "logprobs", id="text-logprobs-over-the-bound"),
    pytest.param(CHAT, chat(logprobs=True, top_logprobs=-1), "top_logprobs",
                 id="top_logprobs-negative"),
    pytest.param(CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs",
                 id="top_logprobs-over-the-bound"),
    pytest.param(CHAT, chat(top_logprobs=2), "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(TEXT, text(echo="yes"), "echo", id="echo-string"),
    pytest.param(CHAT, chat(user=5), "user", id="user-number"),
    pytest.param(CHAT, chat(stop=[1, 2]), "stop", id="stop-numbers"),
    pytest.param(CHAT, chat(seed="x"), "seed", id="seed-string"),
    pytest.param(CHAT, chat(stream="yes"), "stream", id="stream-string"),
    pytest.param(
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        id="include_usage-string",
    ),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model", id="no-model"),
    pytest.param(TEXT, {"model": FAKE_MODEL}, "prompt", id="prompt-missing"),
    pytest.param(TEXT, text(prompt=[1, 2, 3]), "prompt", id="prompt-token-ids"),
    pytest.param(CHAT, ["not", "an", "object"], None, id="body-not-object"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
def test_bad_request_is_400_naming_the_field(
    http: httpx.Client, path: str, body: Any, param: str | None
) -> None:
    error = assert_error_object(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"model": "x",}'])
def test_invalid_json_is_400(http: httpx.Client, raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    assert_error_object(http.post(CHAT, content=raw, headers=headers), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404_model_not_found(
    http: httpx.Client, server: RunningServer, stream: bool, tag: str
) -> None:
    body = chat(model="gpt-17", stream=stream, messages=[{"role": "user", "content": f"tag={tag}"}])
    error = assert_error_object(http.post(CHAT, json=body), 404)
    assert error["code"] == "model_not_found"
    assert tag not in server.backend.runs  # rejected before reaching the backend
    assert assert_error_object(http.get("/v1/models/gpt-17"), 404)["code"] == "model_not_found"


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert assert_error_object(http.get("/v1/nothing"), 404)["code"] == "not_found"
    response = http.get(CHAT)
    assert assert_error_object(response, 405)["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"


def test_accepted_variants(http: httpx.Client, server: RunningServer, tag: str) -> None:
    body = {
        "model": FAKE_MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "tag="}, {"type": "text", "text": tag}],
            }
        ],
        "max_completion_tokens": 4,
        "max_tokens": 99,
        "stop": "END",
        "temperature": None,
        "some_future_field": {"ignored": True},
        "n": 1,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    seen = server.wait_closed(tag).request
    assert seen.messages is not None and seen.messages[0].content == f"tag={tag}"
    assert seen.max_tokens == 4 and seen.stop == ["END"] and seen.temperature == 1.0
    response = http.post(TEXT, json=text(prompt=[f"tag={tag}-list"]))
    assert response.status_code == 200
    assert server.wait_closed(f"{tag}-list").request.max_tokens == 256


def test_bad_requests_leave_a_concurrent_stream_undisturbed(http: httpx.Client) -> None:
    body = chat(stream=True, messages=[{"role": "user", "content": "tokens=10;delay=0.02"}])
    with httpx.Client(base_url=str(http.base_url), timeout=10) as other:
        with other.stream("POST", CHAT, json=body) as good:
            assert good.status_code == 200
            for param in BAD_REQUESTS[:6]:
                path, bad_body, _ = param.values
                assert http.post(path, json=bad_body).status_code == 400
            assert http.post(CHAT, content=b"{").status_code == 400
            payloads = sse_payloads(good.read().decode())
    assert payloads[-1] == "[DONE]"
    content = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-1])
    assert content == "".join(f" t{i}" for i in range(10))
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_failure_mid_stream_is_an_error_event_then_done(http: httpx.Client, path: str) -> None:
    script = "tokens=5;fail_after=2"
    body = chat(stream=True, messages=[{"role": "user", "content": script}])
    if path == TEXT:
        body = text(stream=True, prompt=script)
    response = http.post(path, json=body)
    assert response.status_code == 200  # the status line had gone out before the failure
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    error = payloads[-2]["error"]
    assert error["type"] == "server_error" and "decode peer lost" in error["message"]
    finishes = [c["finish_reason"] for p in payloads[:-2] for c in p["choices"]]
    assert finishes and not any(finishes)  # never "length", never "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_stream_ending_without_finish_is_an_error(http: httpx.Client, stream: bool) -> None:
    body = chat(stream=stream, messages=[{"role": "user", "content": "tokens=2;no_finish=1"}])
    response = http.post(CHAT, json=body)
    if stream:
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["type"] == "server_error"
        assert "length" not in response.text
    else:
        assert assert_error_object(response, 500)["type"] == "server_error"


def test_failure_without_stream_is_500(http: httpx.Client) -> None:
    body = chat(messages=[{"role": "user", "content": "tokens=5;fail_after=2"}])
    error = assert_error_object(http.post(CHAT, json=body), 500)
    assert "decode peer lost" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 413, 503])
def test_backend_rejection_before_first_token_keeps_its_status(
    http: httpx.Client, server: RunningServer, stream: bool, status: int, tag: str
) -> None:
    content = f"tag={tag};reject={status}"
    body = chat(stream=stream, messages=[{"role": "user", "content": content}])
    response = http.post(CHAT, json=body)
    error = assert_error_object(response, status)
    assert error["code"] == "fake" and error["message"] == "rejected by the fake"
    assert response.headers["x-request-id"].startswith("chatcmpl-")
    assert server.wait_closed(tag).closed_by == "error"


def test_health(http: httpx.Client, server: RunningServer) -> None:
    response = http.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    server.backend.healthy = (False, "no decode worker registered")
    try:
        response = http.get("/health")
        assert response.status_code == 503
        assert response.json()["reason"] == "no decode worker registered"
    finally:
        server.backend.healthy = (True, "")


def test_metrics(http: httpx.Client) -> None:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "pdmesh_inflight_requests 0" in response.text
