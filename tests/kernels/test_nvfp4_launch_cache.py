"""Cached launches (libs/kernels/nvfp4/launch_cache.py): a call whose specialization was
seen before skips Triton's JIT launch, one Triton would specialize differently goes
through it, and the outputs are exact either way. GPU only (`gpu`)."""

import pytest
import torch

from .nvfp4_helpers import check_linear_exact, cuda_module, cuda_weight

pytestmark = pytest.mark.gpu
lc = cuda_module("launch_cache")
sk = cuda_module("small_kernel")
from libs.kernels.nvfp4 import linear, triton_kernel  # noqa: E402  (after the skip)


@pytest.fixture
def jit_calls(monkeypatch):
    """Count the calls that reach each kernel's JIT launch."""
    counts = {}
    for name, cache in (("small", sk._LAUNCHES), ("triton", triton_kernel._LAUNCHES)):
        original = cache.kernel.run

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(cache.kernel, "run", counted)
    return counts


def test_specialization_follows_triton():
    t = torch.empty(64, dtype=torch.bfloat16, device="cuda")
    spec = lc._specialization
    assert spec(t) == (torch.bfloat16, True) and spec(t[1:]) == (torch.bfloat16, False)
    assert spec(t[8:]) == spec(t)  # 16 bytes on: still aligned
    assert spec(1) != spec(2) != spec(16)  # 1 is a constant to Triton, 16 divisible
    assert spec(32) == spec(16) and spec(3) == spec(5)
    assert spec(2**31) != spec(2**31 - 16)  # i64 against i32
    assert spec(None) != spec(0.5)
    with pytest.raises(TypeError):
        spec("a string")


def test_a_seen_call_skips_the_jit_and_stays_exact(jit_calls):
    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=21)
    cfg = dict(BN=16, num_warps=4, X_REGS=True)
    wide = torch.randn(3, 584, device="cuda", dtype=torch.bfloat16)
    runs = [
        wide[:, :576],  # aligned
        wide[:, 8:584],  # aligned again (16 bytes on): the same key
        wide[:, 1:577],  # misaligned: a new key
        wide[:1, :576],  # one token: M = 1 is a constant to Triton, a new key
        wide[:, :576],  # seen
    ]
    keys_before = len(sk._LAUNCHES.entries)
    for x in runs:
        out = torch.full((x.shape[0], 576), float("nan"), device="cuda", dtype=torch.bfloat16)
        sk.launch(x, packed, scales, s2, None, out, cfg)
        check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)
    new_keys = len(sk._LAUNCHES.entries) - keys_before
    assert jit_calls.get("small", 0) == new_keys <= 3  # each new key once, nothing else


def test_the_triton_kernel_launches_through_the_cache(jit_calls):
    # SmolLM2's down projection at one token runs the Triton kernel
    packed, scales, s2 = cuda_weight(576, 1536, torch.bfloat16, seed=22)
    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 576, device="cuda", dtype=torch.bfloat16)
    kind, cfg = linear.route(x, packed, scales, out)
    assert kind == "triton"
    outs = []
    for _ in range(3):
        out = torch.full((1, 576), float("nan"), device="cuda", dtype=torch.bfloat16)
        triton_kernel.launch(x, packed, scales, s2, None, out, cfg)
        outs.append(out)
    check_linear_exact(outs[0], x, packed, scales, s2, None, torch.bfloat16)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert jit_calls.get("triton", 0) <= 1  # at most the first (another test may have seen it)
