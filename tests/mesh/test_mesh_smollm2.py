"""The real model through the real mesh: coherent answers for the official OpenAI client,
and greedy tokens equal to transformers' and to our own colocated (no transfer) path."""

from __future__ import annotations

import anyio
import openai
import pytest

from libs.engine.engine import Engine
from libs.engine.generate import generate
from libs.engine.hf_reference import hf_greedy
from libs.engine.kvpool import KvPool
from libs.engine.sampling import SamplingParams
from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import wait_quiet

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how a bicycle works.",
    "Give me a list of ten fruits and one sentence about each.",
]
MIN_TOKENS = 32


def test_openai_client_gets_a_coherent_answer(smol_mesh):
    client = openai.OpenAI(base_url=smol_mesh.base_url, api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=30, temperature=0
    )
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.fixture(scope="module")
def colocated(smollm2):
    loaded = smollm2
    pool = KvPool(loaded.config, 256, 16)
    return loaded, Engine(loaded.config, loaded.weights, pool)


async def _mesh_tokens(mesh, prompt: str) -> list[int]:
    ids: list[int] = []
    async with GenerateClient(mesh.router) as client:
        async for item in client.generate(
            messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
        ):
            if not isinstance(item, Done):
                ids.extend(item.token_ids)
    return ids


async def test_greedy_tokens_equal_transformers_and_colocated(smol_mesh, colocated,
                                                              hf_reference):
    """Every prompt's mesh tokens equal the colocated engine's; the first prompt's also
    equal transformers' (tests/engine/test_smollm2.py holds the engine to transformers on
    other prompts; a transformers decode costs seconds a prompt on a CI core)."""
    loaded, engine = colocated
    for i, prompt in enumerate(PROMPTS):
        mesh_ids = await _mesh_tokens(smol_mesh, prompt)
        assert len(mesh_ids) >= MIN_TOKENS, (prompt, mesh_ids)
        prompt_ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        local = generate(engine, prompt_ids, SamplingParams(temperature=0, max_tokens=48))
        assert mesh_ids == local, prompt
        if i == 0:
            assert mesh_ids == hf_greedy(hf_reference, prompt_ids, len(mesh_ids)), prompt
    await anyio.to_thread.run_sync(wait_quiet, smol_mesh, 2.0)
