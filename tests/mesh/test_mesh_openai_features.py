"""The OpenAI features clients rely on, through the official `openai` client against a
real mesh (tiny, fp32) whose router wants an API key: logprobs and top_logprobs equal to
the fp32 log-softmax of the engine's own logits (computed here, with the same weights, by
a plain dense forward), n choices reproducible by seed, echo with the prompt's logprobs,
the usage chunk, and bad values and keys refused without disturbing the mesh."""

from __future__ import annotations

import anyio
import grpc
import httpx
import openai
import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet
from tests.engine.helpers import dense_logits

KEY = "sk-test-0123456789"
TOLERANCE = 1e-4
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def keyed_mesh(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("keyed"), model="tiny",
                      up_args=["--api-key", KEY])
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def client(keyed_mesh):
    with openai.OpenAI(base_url=keyed_mesh.base_url, api_key=KEY, max_retries=0,
                       timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """The tiny model's engine in this process, and its tokenizer."""
    loaded = load_model("tiny")
    pool = KvPool(loaded.config, 4, 16, dtype=torch.float32)
    return Engine(loaded.config, loaded.weights, pool), loaded.tokenizer


def log_softmax_rows(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i is the distribution of the token after tokens[:i+1]."""
    with torch.inference_mode():
        return torch.log_softmax(dense_logits(engine, tokens).double(), -1)


def check_entry(entry_logprob, entry_bytes, top, row, token_id, tokenizer, top_n):
    """One reported token against the reference row: its logprob, its bytes, and its
    top_n alternatives (logprobs in order, bytes as a set: ties may swap)."""
    assert entry_bytes == list(tokenizer.token_bytes(token_id))
    assert abs(entry_logprob - row[token_id].item()) < TOLERANCE
    values, ids = row.topk(top_n)
    assert len(top) == top_n
    for (_, got_value), want in zip(top, values.tolist(), strict=True):
        assert abs(got_value - want) < TOLERANCE
    assert {bytes(b) for b, _ in top} == {tokenizer.token_bytes(i) for i in ids.tolist()}


def test_chat_logprobs_equal_the_engines_log_softmax(client, reference):
    engine, tokenizer = reference
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    tokens = tokenizer.apply_chat_template(CHAT)
    for entry in content:  # greedy: each token is its row's argmax, fed back for the next
        row = log_softmax_rows(engine, tokens)[-1]
        token_id = int(row.argmax())
        top = [(t.bytes, t.logprob) for t in entry.top_logprobs]
        check_entry(entry.logprob, entry.bytes, top, row, token_id, tokenizer, 5)
        tokens.append(token_id)


def test_streamed_logprobs_and_the_usage_chunk(client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.bytes, e.logprob) for e in streamed] == [
        (e.bytes, e.logprob) for e in whole.choices[0].logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(streamed)
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_are_independent_and_reproducible_by_seed(client):
    def run(n, seed):
        reply = client.completions.create(model="tiny", prompt="Once upon a time",
                                          max_tokens=10, temperature=2.0, n=n, seed=seed)
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.text for c in reply.choices], reply.usage

    texts, usage = run(3, 11)
    assert len(texts) == 3 and len(set(texts)) > 1  # derived seeds: not one answer thrice
    assert run(3, 11)[0] == texts  # reproducible
    assert run(1, 11)[0] == texts[:1]  # choice 0 samples with the request's own seed
    assert usage.completion_tokens >= 3  # the choices' tokens add up


def test_n_choices_stream_interleaved(client):
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time",
                                            max_tokens=5, temperature=2.0, n=3, seed=4,
                                            stream=True))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices[0].finish_reason}
    assert sorted(finishes) == [0, 1, 2]
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
             for i in range(3)]
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                      temperature=2.0, n=3, seed=4)
    assert texts == [c.text for c in whole.choices]


def test_echo_with_logprobs_scores_the_prompt(client, reference):
    """What evaluation harnesses send for log-likelihoods: echo, logprobs, one token."""
    engine, tokenizer = reference
    text = "The quick brown fox jumps over the lazy dog"
    reply = client.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0,
                                      echo=True, logprobs=3)
    choice = reply.choices[0]
    assert choice.text.startswith(text)
    prompt = tokenizer.encode(text)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before it
    assert "".join(lp.tokens[: len(prompt)]) == text
    rows = log_softmax_rows(engine, prompt)
    targets = [*prompt[1:], int(rows[-1].argmax())]
    for i, token_id in enumerate(targets, start=1):
        assert abs(lp.token_logprobs[i] - rows[i - 1][token_id].item()) < TOLERANCE
        want = rows[i - 1].topk(3).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(
            want[: len(lp.top_logprobs[i])], abs=TOLERANCE)
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


async def test_grpc_logprobs_match_http_and_need_the_key(keyed_mesh, client):
    http = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    async with GenerateClient(keyed_mesh.router, api_key=KEY) as grpc_client:
        pieces = [item async for item in grpc_client.generate(
            messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
            user="alice")]
    logprobs = [lp for p in pieces if isinstance(p, Piece) for lp in p.logprobs]
    assert isinstance(pieces[-1], Done)
    assert [lp.logprob for lp in logprobs] == [
        e.logprob for e in http.choices[0].logprobs.content]
    assert all(len(lp.top) == 3 for lp in logprobs)

    for key in (None, "sk-wrong"):
        async with GenerateClient(keyed_mesh.router) as bad:
            bad.metadata = (("authorization", f"Bearer {key}"),) if key else None
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in bad.generate(model="tiny", prompt="hi", max_tokens=2):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await anyio.to_thread.run_sync(wait_quiet, keyed_mesh)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"},
                                     {"authorization": KEY}], ids=["missing", "wrong", "bare"])
def test_a_missing_or_wrong_key_is_401_and_health_and_metrics_stay_open(keyed_mesh, headers):
    root = keyed_mesh.base_url.removesuffix("/v1")
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        reply = httpx.request(method, root + path, json=body if method == "POST" else None,
                              headers=headers, timeout=10)
        assert reply.status_code == 401
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] in ("missing_api_key", "invalid_api_key") and error["message"]
    assert httpx.get(root + "/health", timeout=10).status_code == 200
    assert "pdmesh" in httpx.get(root + "/metrics", timeout=10).text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_mesh.base_url, api_key="sk-wrong",
                      max_retries=0).models.list()
    assert wait_quiet(keyed_mesh)["members"]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("chat/completions", {"n": 0}, "n"),
    ("chat/completions", {"n": 9}, "n"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
])
def test_values_beyond_the_bounds_are_400_and_disturb_nothing(keyed_mesh, client, path,
                                                              fields, param):
    body = {"model": "tiny", "max_tokens": 2, **fields,
            **({"messages": CHAT} if path.startswith("chat") else {"prompt": "hi"})}
    reply = httpx.post(f"{keyed_mesh.base_url}/{path}", json=body,
                       headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    wait_quiet(keyed_mesh)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


async def test_sampled_tokens_report_the_models_distribution_not_the_samplers(
    keyed_mesh, reference
):
    """At temperature 0.7 the logprobs are still the raw logits' log-softmax (what OpenAI
    reports), for the prefill's first token and the decode's after it."""
    engine, tokenizer = reference
    async with GenerateClient(keyed_mesh.router, api_key=KEY) as grpc_client:
        pieces = [item async for item in grpc_client.generate(
            prompt="Once upon a time", max_tokens=6, temperature=0.7, seed=5, logprobs=True,
            ignore_eos=True)]
    logprobs = [lp for p in pieces if isinstance(p, Piece) for lp in p.logprobs]
    tokens = tokenizer.encode("Once upon a time")
    assert len(logprobs) == 6
    for lp in logprobs:
        row = log_softmax_rows(engine, tokens)[-1]
        assert abs(lp.logprob - row[lp.token_id].item()) < TOLERANCE
        tokens.append(lp.token_id)
