"""The fused layer kernels (libs/kernels/fused_layer.py) against the engine's torch ops,
and an engine decoding through them against the same engine on the torch ops.

Where there is a GPU they run compiled on it; elsewhere under Triton's interpreter on CPU
tensors, in a subprocess with TRITON_INTERPRET=1 (the interpreter must be chosen before
triton is first imported; see test_paged_attention.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.engine import model  # noqa: E402
from libs.engine.config import ModelConfig  # noqa: E402
from libs.engine.engine import DecodeSeq, Engine  # noqa: E402
from libs.engine.kvpool import KvPool  # noqa: E402
from tests.kernels.interpreted import (  # noqa: E402
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels,
    run_module_interpreted,
)

if CUDA or INTERPRETED:
    from libs.kernels import fused_layer as fl


def test_kernels_under_the_interpreter():
    """This module's tests, run by Triton's interpreter in a fresh process."""
    run_module_interpreted(__file__)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# A rounding or two of the model dtype apart at most: a sum's order moves rstd by an fp32
# ulp, and the interpreter's fp32 to bf16 cast may round the other way (two ulps ~ 8e-3).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _same_rounding(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal where the rounding to the dtype is torch's (compiled, or fp32/fp16); under
    the interpreter its fp32 to bf16 cast may round the other way by one ulp."""
    if CUDA or got.dtype != torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, atol=TOL[got.dtype], rtol=TOL[got.dtype])


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 64), (1, 5, 576)], ids=["decode", "prefill-576"])
def test_add_rms_norm_matches_torch(dtype, shape):
    """576 (SmolLM2's dim) is not a power of two: the kernel masks the tail."""
    x, delta = _randn(*shape, dtype=dtype), _randn(*shape, dtype=dtype, seed=1)
    w = _randn(shape[-1], dtype=dtype, seed=2)
    ref_x = x + delta
    got = fl.add_rms_norm(x, delta, w, 1e-5)
    _same_rounding(x, ref_x)  # the residual add, in place
    ref = model._torch_rms_norm(x, w, 1e-5)  # of the sum the kernel kept
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])
    plain = fl.rms_norm(ref_x, w, 1e-5)
    torch.testing.assert_close(plain, ref, atol=TOL[dtype], rtol=TOL[dtype])
    _same_rounding(x, ref_x)  # rms_norm leaves its input alone


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(3,), (1, 7)], ids=["decode", "prefill"])
def test_rope_qk_matches_torch(dtype, lead):
    """GQA (6 q heads, 2 k heads), the fused qkv row, positions far apart."""
    h, hkv, d = 6, 2, 32
    c = ModelConfig.tiny()
    c = ModelConfig(**{**vars(c), "n_heads": h, "n_kv_heads": hkv, "head_dim": d})
    cos_t, sin_t = model.rope_tables(c, DEVICE, dtype)
    n = int(torch.tensor(lead).prod())
    positions = torch.tensor([0, 1, 900, 17, 2047, 5, 64][:n], device=DEVICE)
    cos, sin = cos_t[positions].view(*lead, 1, d), sin_t[positions].view(*lead, 1, d)
    qkv = _randn(*lead, (h + 2 * hkv) * d, dtype=dtype)
    q_ref = model.apply_rope(qkv[..., : h * d].view(*lead, h, d), cos, sin)
    k_ref = model.apply_rope(qkv[..., h * d : (h + hkv) * d].view(*lead, hkv, d), cos, sin)
    q, k = fl.rope_qk(qkv, cos, sin, h, hkv, d)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape and q.is_contiguous()
    # Rounded where torch rounds: equal up to fp32 products' last bit.
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])


@kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ffn", [128, 1536 + 7], ids=["128", "ragged"])
def test_silu_mul_matches_torch(dtype, ffn):
    """A width over one block and not a multiple of it."""
    gate_up = _randn(2, 3, 2 * ffn, dtype=dtype) * 3
    gate, up = gate_up.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    got = fl.silu_mul(gate_up)
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])


def _decode(fused: bool, dtype: torch.dtype, cuda_graphs: bool = False,
            forced: list[list[int]] | None = None):
    """Prefill three prompts, then 6 batched decode steps: (tokens, logits [21, V]). The
    tokens are greedy, or `forced`'s (teacher forcing, so that two runs compare their
    logits at the same inputs even where a near-tie would send greedy apart)."""
    config = ModelConfig.tiny()
    old, model.FUSED_KERNELS = model.FUSED_KERNELS, fused
    try:
        w = model.random_weights(config, seed=5).to(DEVICE, dtype)
        pool = KvPool(config, 64, 16, device=DEVICE, dtype=dtype)
        kwargs = {"cuda_graphs": cuda_graphs} if CUDA else {}
        eng = Engine(config, w, pool, max_batch=4, **kwargs)
        g = torch.Generator().manual_seed(9)
        seqs, logits = [], []
        for n in (4, 19, 40):
            prompt = torch.randint(3, config.vocab_size, (n,), generator=g).tolist()
            pages = pool.alloc(pool.pages_for(n + 6))
            logits.append(eng.prefill(prompt, pages))
            seqs.append(DecodeSeq(pages, n, 0))
        tokens = []
        for step in range(7):
            rows = logits[-len(seqs):]
            tokens.append(forced[step] if forced else [int(r.argmax()) for r in rows])
            if step == 6:
                break
            for s, token in zip(seqs, tokens[-1], strict=True):
                s.token = token
            logits.extend(eng.decode_step(seqs))
            for s in seqs:
                s.pos += 1
        return tokens, torch.stack(logits).float().cpu()
    finally:
        model.FUSED_KERNELS = old


def _assert_bf16_as_close_as_torch(tokens, logits) -> None:
    """bf16 logits at `tokens` as close to the fp32 torch ops' as the bf16 torch ops' are
    (within 2x): a fused kernel that drops or misplaces a term is far outside that."""
    exact = _decode(False, torch.float32, forced=tokens)[1]
    ref = _decode(False, torch.bfloat16, forced=tokens)[1]

    def error(x: torch.Tensor) -> float:
        return float((x - exact).norm() / exact.norm())

    assert error(logits) <= 2 * error(ref) + 1e-3, (error(logits), error(ref))


@kernels
def test_engine_through_fused_kernels_matches_torch_ops():
    """The whole engine (prefill and batched decode) through every fused kernel against
    the torch ops: in fp32 the same greedy tokens and logits within 1e-4; in bf16 (at the
    fp32 run's tokens) as close to fp32 as the torch ops in bf16 are."""
    ref_tokens, ref_logits = _decode(False, torch.float32)
    tokens, logits = _decode(True, torch.float32)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    _assert_bf16_as_close_as_torch(ref_tokens, _decode(True, torch.bfloat16, forced=ref_tokens)[1])


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_smoke_fused_graph_decode_matches_torch_ops():
    """On the GPU in bf16: graphed decode through the fused kernels replays its own eager
    forward bit for bit, and is as close to the fp32 torch ops as the bf16 torch ops are."""
    tokens, logits = _decode(True, torch.bfloat16, cuda_graphs=True)
    eager_tokens, eager_logits = _decode(True, torch.bfloat16)
    assert tokens == eager_tokens and torch.equal(logits, eager_logits)
    _assert_bf16_as_close_as_torch(tokens, logits)
