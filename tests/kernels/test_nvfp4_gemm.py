"""The warp-specialized Gluon GEMM (libs/kernels/nvfp4/gemm_kernel.py) on CUDA: its configs
against the exact product (ragged M and N, bias, fp16, split K in two and in four, ring
depths, steps read ahead), every e4m3 scale code and byte, determinism, no writes outside
the output, and nvfp4_linear's routing to it. GPU only (marked `gpu`)."""

import pytest
import torch

from .nvfp4_helpers import (
    check_linear_exact,
    count_exact_on_shapes,
    cuda_weight,
    gluon_kernel,
    repeated_launches,
)
from .nvfp4_helpers import gemm_config as _cfg

pytestmark = pytest.mark.gpu
CUDA = "cuda"
gk = gluon_kernel("gemm_kernel")
from libs.kernels.nvfp4 import linear_kernels as lk  # noqa: E402  (after the skip)

CONFIGS = [_cfg(), _cfg(bm=128), _cfg(split=2), _cfg(bm=128, split=4), _cfg(w_stages=1),
           _cfg(w_stages=4), _cfg(stages=3), _cfg(stages=2, w_stages=3), _cfg(bm=64),
           _cfg(bm=32, split=2), _cfg(bm=16), _cfg(bm=128, maxnreg=232),
           _cfg(bm=128, PAD_X=False), _cfg(bm=32, PAD_X=True),  # x past M: TMA zeros / a copy
           _cfg(X_STEPS=2, stages=3), _cfg(bm=64, split=2, X_STEPS=4, stages=2),
           # each step read ahead, scale conversions shared across the quad
           _cfg(X_STEPS=2, stages=3, LOOKAHEAD=True), _cfg(bm=128, split=2, LOOKAHEAD=True),
           _cfg(bm=128, X_STEPS=2, stages=4, LOOKAHEAD=True),
           _cfg(bm=16, w_stages=1, LOOKAHEAD=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_configs_match_exact(cfg, dtype):
    shapes = ((256, 1024, 100), (200, 2048, 256), (64, 4096, 300), (1000, 768, 129),
              (136, 2048, 17))
    ran = count_exact_on_shapes(gk, cfg, shapes, dtype)
    assert ran >= 3, cfg  # every config meets at least three of the shapes


@pytest.mark.parametrize("m", [256, 700, 1500])  # 32-, 64- and 128-token tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_small_layer_configs_match_exact(dtype, m):
    # the configs _small_layer_config picks, on SmolLM2's down projection and ragged
    # neighbours: M not whole token tiles, N not a multiple of 64, a shorter K
    cfg = gk.pick_config(m, 576, 1536)
    assert cfg["BM"] == {256: 32, 700: 64, 1500: 128}[m]
    shapes = ((576, 1536, m), (576, 1536, m - 55), (200, 1536, m - 127), (576, 1024, m + 44))
    assert count_exact_on_shapes(gk, cfg, shapes, dtype) == len(shapes)


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_every_scale_code_and_byte(dtype, lookahead):
    packed, scales, s2 = cuda_weight(256, 4096, dtype, seed=3, random_scales=True)
    x = torch.randn(130, 4096, device=CUDA).to(dtype)
    out = torch.full((130, 256), float("nan"), device=CUDA, dtype=dtype)
    gk.launch(x, packed, scales, s2, None, out, _cfg(split=2, LOOKAHEAD=lookahead))
    check_linear_exact(out, x, packed, scales, s2, None, dtype)


def test_gemm_is_deterministic_and_leaves_counters_clean():
    outs = repeated_launches(gk, _cfg(split=4), n=512, k=4096, m=256)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert not lk._tile_counters(outs[0].device, 16)[:16].any()  # arrivals, partials


def test_gemm_does_not_write_past_m_or_n():
    packed, scales, s2 = cuda_weight(120, 1024, torch.bfloat16, seed=5)
    x = torch.randn(70, 1024, device=CUDA, dtype=torch.bfloat16)
    big = torch.full((300, 136), 7.0, device=CUDA, dtype=torch.bfloat16)
    out = big[:70, :120]  # row stride 136 (272 bytes): writes past n or m show in big
    gk.launch(x, packed, scales, s2, None, out, _cfg(bm=128))
    assert (big[70:] == 7).all() and (big[:, 120:] == 7).all()
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


def test_wide_layers_run_the_tokens_past_whole_tiles_as_a_second_launch():
    # whole_tiles_first (its rule: test_nvfp4_gemm_configs.py) on the GPU: two launches
    packed, scales, s2 = cuda_weight(8192, 2048, torch.bfloat16, seed=7)
    bias = torch.randn(8192, device=CUDA, dtype=torch.bfloat16)
    for m in (300, 330, 384):  # the rest in a 64-token tile, a copied 128 one, a whole 128
        x = torch.randn(m, 2048, device=CUDA, dtype=torch.bfloat16)
        big = torch.full((m + 40, 8256), 7.0, device=CUDA, dtype=torch.bfloat16)
        out = big[:m, :8192]  # writes past n or m show in big
        cfg = gk.pick_config(m, 8192, 2048)
        assert cfg["HEAD"] == 256 and gk.needs_pad(m, cfg) == (m == 330)
        gk.launch(x, packed, scales, s2, bias, out, cfg)
        assert (big[m:] == 7).all() and (big[:, 8192:] == 7).all()
        check_linear_exact(out, x, packed, scales, s2, bias, torch.bfloat16)


def test_linear_routes_to_the_gemm_only_where_it_can():
    # nvfp4_linear hands 256 tokens on this layer to the GEMM; x starting 2 bytes into a
    # buffer cannot make a TMA descriptor and takes the Triton kernel instead. Both must
    # hold the bound.
    from libs.kernels import nvfp4_linear

    n, k = 4096, 4096
    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=6)
    x = torch.randn(256, k, device=CUDA, dtype=torch.bfloat16)
    buf = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device=CUDA)
    shifted = buf[1:].view(256, k)
    shifted.copy_(x)
    out = torch.empty(256, n, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "gemm"
    assert lk.route(shifted, packed, scales, out)[0] == "triton"
    assert lk.route(x[:16], packed, scales, out[:16])[0] == "triton"
    assert lk.route(x[:17], packed, scales, out[:17])[0] == "gemm"
    assert lk.route(x[:1], packed, scales, out[:1])[0] == "gemv"
    for xx in (x, shifted):
        check_linear_exact(nvfp4_linear(xx, packed, scales, s2), xx, packed, scales, s2, None,
               torch.bfloat16)
