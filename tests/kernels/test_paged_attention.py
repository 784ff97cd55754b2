"""The paged decode-attention kernels against the engine's torch attention.

Where there is a GPU they run compiled on it; elsewhere under Triton's interpreter on CPU
tensors (so CI checks the kernels' logic without a GPU). The interpreter must be chosen
before triton is first imported (its own library functions are jit functions too), so on
a CPU-only run one test re-runs this module in a subprocess with TRITON_INTERPRET=1. The
reference is the engine's CPU decode attention (libs/engine/attention.py): the pages
gathered, grouped matmuls.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.engine.attention import DecodeAttention  # noqa: E402
from tests.kernels.interpreted import (  # noqa: E402
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels,
    run_module_interpreted,
)

if CUDA or INTERPRETED:
    from libs.kernels import paged_attention as pa


def test_kernels_under_the_interpreter():
    """This module's tests, run by Triton's interpreter in a fresh process."""
    run_module_interpreted(__file__)


TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _step(page_size: int, hkv: int, group: int, d: int, lengths: list[int],
          dtype: torch.dtype, seed: int = 0, n_layers: int = 2):
    """A random pool, a random page table (distinct pages per sequence), and q/k/v."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-max(lengths) // page_size), 1)
    n_pages = width * len(lengths) + 3
    cache = torch.randn(n_pages, n_layers, 2, hkv, page_size, d, generator=g).to(dtype)
    perm = torch.randperm(n_pages, generator=g)[: width * len(lengths)]
    table = perm.view(len(lengths), width).to(torch.int32)
    b, h = len(lengths), hkv * group
    q, k, v = (torch.randn(b, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    return cache, table, lengths_t, q, k, v


def _run_reference(cache, table, lengths, q, k, v, layer):
    """The engine's CPU attention on CPU copies: (pool after the store, output [B, H, D])."""
    cache = cache.clone()
    out = DecodeAttention(cache, table, lengths)(q, k, v, layer)
    return cache, out.view(q.shape)


def _run_kernels(cache, table, lengths, q, k, v, layer, splits):
    to = {"device": DEVICE}
    cache, table, lengths = cache.clone().to(**to), table.to(**to), lengths.to(**to)
    q, k, v = q.to(**to), k.to(**to), v.to(**to)
    pa.store_kv(k, v, cache, layer, table, lengths)
    out = pa.paged_decode_attention(q, cache, layer, table, lengths, splits)
    return cache.cpu(), out.cpu()


CASES = [  # page_size, kv heads, query heads per kv head, head_dim, dtype
    (5, 3, 3, 64, torch.float32),  # SmolLM2's grouping, a page size that is not 2^k
    (1, 1, 4, 32, torch.bfloat16),
    (32, 2, 1, 16, torch.float16),  # no grouping (MHA)
    (16, 3, 3, 64, torch.bfloat16),
    (8, 1, 8, 128, torch.float16),  # a wide group and head
]


@kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: "ps{}-kv{}-g{}-d{}-{}".format(*c))
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_engine_attention(case, splits):
    """Ragged lengths (a padding row of length 0 among them), random pages, GQA."""
    page_size, hkv, group, d, dtype = case
    lengths = [1, 37, 0, 70, page_size]
    cache, table, lens, q, k, v = _step(page_size, hkv, group, d, lengths, dtype)
    ref_cache, ref = _run_reference(cache, table, lens, q, k, v, layer=1)
    got_cache, got = _run_kernels(cache, table, lens, q, k, v, layer=1, splits=splits)
    assert torch.equal(got_cache, ref_cache)  # the same slots written, nothing else
    live = lens > 0
    torch.testing.assert_close(got[live].float(), ref[live].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert (got[~live] == 0).all()  # a padding row attends to nothing


@kernels
def test_splits_agree_and_padding_writes_nothing():
    cache, table, lens, q, k, v = _step(4, 2, 2, 16, [0, 0, 0], torch.float32)
    before = cache.clone()
    after, out = _run_kernels(cache, table, lens, q, k, v, layer=0, splits=4)
    assert torch.equal(after, before) and (out == 0).all()
    cache, table, lens, q, k, v = _step(4, 1, 2, 16, [150, 3], torch.float32, seed=1)
    one = _run_kernels(cache, table, lens, q, k, v, layer=0, splits=1)[1]
    for splits in (2, 5):
        many = _run_kernels(cache, table, lens, q, k, v, layer=0, splits=splits)[1]
        torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)
    # the last split of each (sequence, KV head) combined and left its counter at zero
    from libs.kernels import split_counters

    assert split_counters._counters and not any(
        buf.any() for buf in split_counters._counters.values())


@kernels
def test_num_splits_fills_the_gpu_without_tiny_splits():
    dev = torch.device(DEVICE)
    sms = pa.sm_count(dev)
    for batch in (1, 2, 7, 64, 128, 256):
        for max_len in (1, 100, 512, 8192):
            s = pa.num_splits(batch, 3, max_len, dev)
            assert 1 <= s <= pa.MAX_SPLITS
            assert s == 1 or (s - 1) * 2 * pa.BLOCK_N < max_len  # every split has 2 blocks
            assert s == 1 or batch * 3 * (s - 1) < 2 * sms  # no more than needed
    assert pa.num_splits(1, 3, 8192, dev) > 8  # batch 1 at 8k spreads over the GPU


@kernels
def test_bad_arguments_are_typed_errors():
    cache, table, lens, q, k, v = _step(16, 2, 2, 16, [5, 9], torch.float32)
    with pytest.raises(TypeError, match="int32"):
        pa.paged_decode_attention(q, cache, 0, table.long(), lens, 1)
    with pytest.raises(TypeError, match="cache"):
        pa.paged_decode_attention(q.double(), cache, 0, table, lens, 1)
    with pytest.raises(ValueError, match="layer"):
        pa.paged_decode_attention(q, cache, 2, table, lens, 1)
    with pytest.raises(ValueError, match="splits"):
        pa.paged_decode_attention(q, cache, 0, table, lens, 0)
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_decode_attention(q[:, :3], cache, 0, table, lens, 1)
    with pytest.raises(ValueError, match="B=2"):
        pa.store_kv(k, v, cache, 0, table[:1], lens)
    with pytest.raises(ValueError, match="contiguous pool"):
        pa.store_kv(k, v, cache.transpose(0, 1), 0, table, lens)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("batch,length", [(1, 8192), (128, 512), (3, 3000)])
def test_gpu_smollm2_shapes(batch, length):
    """SmolLM2's heads in bf16: batch 1 at 8k context (many splits), batch 128 at 512."""
    dev = torch.device("cuda")
    lengths = [length - i for i in range(batch)]
    cache, table, lens, q, k, v = _step(16, 3, 3, 64, lengths, torch.bfloat16, n_layers=2)
    splits = pa.num_splits(batch, 3, length, dev)
    ref_cache, ref = _run_reference(cache, table, lens, q, k, v, layer=1)
    got_cache, got = _run_kernels(cache, table, lens, q, k, v, layer=1, splits=splits)
    assert torch.equal(got_cache, ref_cache)
    # The kernel keeps scores and probabilities in fp32, the reference rounds them to bf16:
    # both are compared with the fp32 truth, the kernel must be no further from it.
    truth = _run_reference(cache.float(), table, lens, q.float(), k.float(), v.float(), 1)[1]
    err_kernel = (got.float() - truth).abs().max().item()
    err_ref = (ref.float() - truth).abs().max().item()
    assert err_kernel <= max(err_ref, 1e-2), (err_kernel, err_ref)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_smoke_paged_attention():
    cache, table, lens, q, k, v = _step(16, 3, 3, 64, [1000, 1, 0, 77], torch.bfloat16)
    ref_cache, ref = _run_reference(cache, table, lens, q, k, v, layer=0)
    for splits in (1, 8):
        got_cache, got = _run_kernels(cache, table, lens, q, k, v, layer=0, splits=splits)
        assert torch.equal(got_cache, ref_cache)
        torch.testing.assert_close(got[:2].float(), ref[:2].float(), atol=2e-2, rtol=2e-2)


@kernels
@pytest.mark.gpu
@pytest.mark.gpu_smoke  # compiled on a GPU in the smoke tier
@pytest.mark.parametrize("case", CASES, ids=lambda c: "ps{}-kv{}-g{}-d{}-{}".format(*c))
def test_rope_store_is_rope_then_store_bit_for_bit(case):
    """The fused decode-step kernel against fused_layer.rope_qk then store_kv: the same q,
    the same pool after (a padding row writes nothing, every other slot is untouched)."""
    from libs.kernels import fused_layer

    page_size, hkv, group, d, dtype = case
    lengths = [1, 37, 0, 70, page_size]
    cache, table, lens, q, k, v = _step(page_size, hkv, group, d, lengths, dtype, seed=3)
    h = hkv * group
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(len(lengths), (h + 2 * hkv) * d, generator=g).to(dtype)
    angle = torch.rand(len(lengths), 1, d // 2, generator=g) * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)  # [B, 1, D], as decode's
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)
    to = {"device": DEVICE}
    cache, table, lens = cache.to(**to), table.to(**to), lens.to(**to)
    qkv, cos, sin = qkv.to(**to), cos.to(**to), sin.to(**to)
    want_cache = cache.clone()
    want_q, want_k = fused_layer.rope_qk(qkv, cos, sin, h, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(len(lengths), hkv, d)
    pa.store_kv(want_k, v, want_cache, 1, table, lens)
    got_q = pa.rope_store_kv(qkv, cos, sin, cache, 1, table, lens, h)
    assert torch.equal(got_q, want_q) and torch.equal(cache, want_cache)
    assert not torch.equal(cache[:, 1], _step(page_size, hkv, group, d, lengths, dtype,
                                              seed=3)[0][:, 1].to(**to))  # it did write


@kernels
def test_rope_store_refuses_a_qkv_that_does_not_match_the_pool():
    cache, table, lens, *_ = _step(16, 2, 2, 16, [5, 9], torch.float32)
    to = {"device": DEVICE}
    cache, table, lens = cache.to(**to), table.to(**to), lens.to(**to)
    cos = torch.ones(2, 16, **to)
    with pytest.raises(ValueError, match="qkv must be"):
        pa.rope_store_kv(torch.zeros(2, 7 * 16, **to), cos, cos, cache, 0, table, lens, 4)
    with pytest.raises(TypeError, match="int32"):
        pa.rope_store_kv(torch.zeros(2, 8 * 16, **to), cos, cos, cache, 0, table.long(),
                         lens, 4)
