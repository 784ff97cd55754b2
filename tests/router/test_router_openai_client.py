"""The official openai client against the router's HTTP layer under a real uvicorn."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from router_fakes import FAKE_MODEL, RunningServer


@pytest.fixture
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=10
    ) as client:
        yield client


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [FAKE_MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(FAKE_MODEL).id == FAKE_MODEL


def test_chat_completion(client: openai.OpenAI, server: RunningServer, tag: str) -> None:
    completion = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"tag={tag};tokens=3"},
        ],
        max_tokens=10,
        temperature=0,
        seed=5,
        stop=["END"],
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == " t0 t1 t2"
    assert completion.choices[0].finish_reason == "stop"
    usage = completion.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 3, 10)

    run = server.wait_closed(tag)
    assert run.closed_by == "finished"  # ran to its end: not mistaken for an abort
    seen = run.request
    assert seen.kind == "chat" and seen.max_tokens == 10 and seen.temperature == 0.0
    assert seen.seed == 5 and seen.stop == ["END"] and not seen.stream
    assert [m.role for m in seen.messages or []] == ["system", "user"]
    assert seen.request_id == completion.id


def test_chat_completion_hits_max_tokens(client: openai.OpenAI, tag: str) -> None:
    completion = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[{"role": "user", "content": f"tag={tag};tokens=50"}],
        max_completion_tokens=2,
    )
    assert completion.choices[0].message.content == " t0 t1"
    assert completion.choices[0].finish_reason == "length"


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream(client: openai.OpenAI, server: RunningServer, include_usage: bool) -> None:
    stream = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[{"role": "user", "content": "tokens=4"}],
        stream=True,
        stream_options={"include_usage": include_usage},
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)

    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == " t0 t1 t2 t3"
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[-1] == "stop" and not any(finishes[:-1])

    if include_usage:
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 4 and last.usage.total_tokens == 11
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completion(client: openai.OpenAI, server: RunningServer, tag: str) -> None:
    completion = client.completions.create(
        model=FAKE_MODEL, prompt=f"tag={tag};tokens=2", max_tokens=5, top_p=0.5
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text == " t0 t1"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.total_tokens == 9
    run = server.wait_closed(tag)
    assert run.closed_by == "finished"
    seen = run.request
    assert seen.kind == "completion" and seen.prompt == f"tag={tag};tokens=2"
    assert seen.top_p == 0.5 and seen.temperature == 1.0


def test_completion_stream_with_usage(
    client: openai.OpenAI, server: RunningServer, tag: str
) -> None:
    chunks = list(
        client.completions.create(
            model=FAKE_MODEL,
            prompt=f"tag={tag};tokens=3",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == " t0 t1 t2"
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    assert server.wait_closed(tag).closed_by == "finished"


def test_mid_stream_failure_raises_in_client(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=FAKE_MODEL,
        messages=[{"role": "user", "content": "tokens=5;fail_after=2"}],
        stream=True,
    )
    received = []
    with pytest.raises(openai.APIError, match="decode peer lost"):
        for chunk in stream:
            received.append(chunk)
    assert all(c.choices[0].finish_reason is None for c in received)


def test_rejection_before_first_token_raises_status_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=FAKE_MODEL, messages=[{"role": "user", "content": "reject=400"}], stream=True
        )
    assert caught.value.code == "fake"
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="hi")
    assert not_found.value.code == "model_not_found"
