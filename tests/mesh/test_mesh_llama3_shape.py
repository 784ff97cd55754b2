"""random:llama3-1b through a whole mesh on the CPU: a vocabulary of 128,256 behind
SmolLM2's tokenizer of 49,152 (specs.random_config), greedy tokens streamed by id, the
text of the ids the tokenizer has."""

from __future__ import annotations

import pytest

from libs.engine.specs import load_tokenizer
from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet

TOKENS = 6


@pytest.fixture(scope="module")
def llama3_mesh(tmp_path_factory):
    mesh = start_mesh(
        tmp_path_factory.mktemp("llama3"), model="random:llama3-1b", dtype="bfloat16",
        timeout=300.0, up_args=["--prefill-args", "--kv-pages 16",
                                "--decode-args", "--kv-pages 16 --max-batch 2"],
    )
    yield mesh
    wait_quiet(mesh, 30)  # no request or KV page left behind
    mesh.stop()


async def test_llama3_1b_streams_greedy_tokens_past_the_tokenizers_vocabulary(llama3_mesh):
    _, tok = load_tokenizer("random:llama3-1b")
    pieces: list[Piece] = []
    async with GenerateClient(llama3_mesh.router) as client:
        async for item in client.generate(prompt="The capital of France is",
                                          max_tokens=TOKENS, temperature=0, ignore_eos=True):
            if isinstance(item, Done):
                assert item.completion_tokens == TOKENS
            else:
                pieces.append(item)
    ids = [t for p in pieces for t in p.token_ids]
    assert len(ids) == TOKENS and all(0 <= t < 128256 for t in ids)
    assert "".join(p.text for p in pieces) == tok.decode([t for t in ids if t < tok.vocab_size])
