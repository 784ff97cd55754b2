"""Prefill through CUDA graphs: a replayed pack equals the same padded pack launched
eagerly, bit for bit (logits and every KV slot), and the unpadded eager pack within
rounding; a pack no bucket holds runs eagerly."""

from __future__ import annotations

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import Engine, PrefillSeq
from libs.engine.kvpool import KvPool
from libs.engine.model import random_weights
from libs.engine.prefill_pack import pack_prefill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _engines(dtype: torch.dtype) -> tuple[Engine, Engine]:
    """(eager, graphed) engines on the GPU, same weights, prefill graphs up to 512."""
    config = ModelConfig.smollm2()
    w = random_weights(config, seed=5).to("cuda", dtype)
    out = []
    for graphs in (False, True):
        pool = KvPool(config, 96, 16, device="cuda", dtype=dtype)
        out.append(Engine(config, w, pool, cuda_graphs=graphs, max_context=2048))
    assert out[0].capture_prefill_graphs(512) == []  # no graphs: nothing captured
    assert (512, 2048, 32) in out[1].capture_prefill_graphs(512)
    return out[0], out[1]


def _pack(eng: Engine) -> tuple[list[PrefillSeq], list[int]]:
    """A 300-token sequence's second chunk (its first 128 tokens are in the pool) packed
    with a fresh 45-token prompt. Page 0 is left alone: capture wrote there."""
    gen = torch.Generator().manual_seed(9)
    a, b = (torch.randint(3, eng.config.vocab_size, (n,), generator=gen).tolist()
            for n in (300, 45))
    eng.pool.alloc(1)
    pa, pb = eng.pool.alloc(eng.pool.pages_for(300)), eng.pool.alloc(eng.pool.pages_for(45))
    return [PrefillSeq(a[:128], pa, 0)], [PrefillSeq(a[128:], pa, 128), PrefillSeq(b, pb, 0)]


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_graph_prefill_equals_the_padded_eager_pack(dtype):
    eager, graphed = _engines(dtype)
    logits, pools = [], []
    for eng in (eager, graphed):
        first, pack = _pack(eng)
        got = []
        for seqs in (first, pack):
            t = sum(len(s.tokens) for s in seqs)
            k = sum(s.start_pos + len(s.tokens) for s in seqs)
            bucket = graphed.prefill_graphs.bucket(t, k, len(seqs))
            assert bucket is not None
            if eng is graphed:
                got.append(eng.prefill_batch(seqs))
            else:  # the same padded pack, launched eagerly
                packed = pack_prefill([(s.tokens, s.pages, s.start_pos, False) for s in seqs],
                                      eng.pool.page_size, bucket)
                data = torch.from_numpy(packed.data).cuda()
                with torch.inference_mode():
                    got.append(eng.prefill_packed(data, *bucket)[: len(seqs)])
        logits.append(torch.cat(got).cpu())
        pools.append(eng.pool.tensor[1:].cpu())
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(pools[0], pools[1])


def test_graph_prefill_is_the_unpadded_prefill_within_rounding():
    eager, graphed = _engines(torch.float32)
    got = []
    for eng in (eager, graphed):
        first, pack = _pack(eng)
        got.append(torch.cat([eng.prefill_batch(first), eng.prefill_batch(pack)]).cpu())
    torch.testing.assert_close(got[1], got[0], atol=2e-3, rtol=2e-3)
    assert torch.equal(got[1].argmax(-1), got[0].argmax(-1))


def test_a_pack_no_bucket_holds_runs_eagerly():
    """Prompt logprobs want every row: more rows than any bucket, so eager, same result."""
    eager, graphed = _engines(torch.float32)
    got = []
    for eng in (eager, graphed):
        _, pack = _pack(eng)
        seqs = [PrefillSeq(s.tokens, s.pages, s.start_pos, all_logits=True) for s in pack]
        got.append(eng.prefill_batch(seqs).cpu())
    assert got[1].shape == (172 + 45, graphed.config.vocab_size)
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=1e-5)
