"""CUDA and CPU engines agree on the same seeded random weights."""

from __future__ import annotations

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import DecodeSeq, Engine
from libs.engine.generate import generate
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights
from libs.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _engines(config: ModelConfig, num_pages: int = 64):
    w = random_weights(config, seed=1234)
    out = []
    for dev in ("cpu", "cuda"):
        pool = KvPool(config, num_pages, 16, device=dev, dtype=torch.float32)
        out.append(Engine(config, w.to(dev, torch.float32), pool))
    return out


@pytest.mark.parametrize(
    "config", [ModelConfig.tiny(), ModelConfig.smollm2()], ids=["tiny", "smollm2"]
)
def test_cuda_matches_cpu(config):
    cpu, gpu = _engines(config)
    prompt = torch.randint(3, config.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    pc, pg = cpu.pool.alloc(4), gpu.pool.alloc(4)
    lc, lg = cpu.prefill(prompt, pc), gpu.prefill(prompt, pg)
    torch.testing.assert_close(lg.cpu(), lc, atol=1e-3, rtol=1e-3)
    sc, sg = DecodeSeq(pc, 45, 7), DecodeSeq(pg, 45, 7)
    step_c, step_g = cpu.decode_step([sc]), gpu.decode_step([sg])
    torch.testing.assert_close(step_g.cpu(), step_c, atol=1e-3, rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert generate(gpu, prompt, params, chunk_size=20) == generate(cpu, prompt, params)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    assert generate(gpu, prompt, sampled) == generate(cpu, prompt, sampled)


def test_cuda_bf16_runs():
    config = ModelConfig.tiny()
    w = random_weights(config, seed=1).to("cuda", torch.bfloat16)
    eng = Engine(config, w, KvPool(config, 16, 16, device="cuda", dtype=torch.bfloat16))
    logits = eng.prefill(list(range(3, 40)), eng.pool.alloc(3))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
