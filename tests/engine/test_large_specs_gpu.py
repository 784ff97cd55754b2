"""The Llama-3 shapes on a GPU: drawn there in the dtype, NVFP4 quantized there, the bytes
the budget counts, and NVFP4 greedy tokens through the CUDA graphs equal to eager."""

from __future__ import annotations

import time

import pytest
import torch

from libs.engine.engine import Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from libs.engine.nvfp4 import Nvfp4Weight
from libs.engine.weight_budget import weight_bytes
from pdmesh.bench.nvfp4_engine import greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("fmt", ["native", "nvfp4"])
def test_llama3_1b_is_drawn_on_the_gpu_in_seconds_at_the_budgeted_bytes(fmt):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    m = load_model("random:llama3-1b", "cuda", torch.bfloat16, fmt)
    took = time.perf_counter() - t0
    held = torch.cuda.memory_allocated() - before
    assert m.weights.embed.is_cuda and m.weights.embed.dtype == torch.bfloat16
    assert isinstance(m.weights.layers[0].w_down, Nvfp4Weight) == (fmt == "nvfp4")
    expected = weight_bytes(m.config, torch.bfloat16, fmt, "cuda")
    assert abs(held - expected) < 0.02 * expected, (held, expected)
    assert took < 30, took
    del m
    torch.cuda.empty_cache()


@pytest.mark.gpu_smoke
def test_llama3_1b_nvfp4_greedy_tokens_of_the_graphs_equal_eager():
    m = load_model("random:llama3-1b", "cuda", torch.bfloat16, "nvfp4")
    pool = KvPool(m.config, 64, 16, device="cuda", dtype=torch.bfloat16)
    graphed = Engine(m.config, m.weights, pool, max_batch=8, max_context=512)
    eager = Engine(m.config, m.weights, pool, max_batch=8, max_context=512, cuda_graphs=False)
    prompt = list(range(1000, 1040))
    a, b = greedy(graphed, pool, prompt, 32), greedy(eager, pool, prompt, 32)
    assert graphed.graphs is not None and a == b
