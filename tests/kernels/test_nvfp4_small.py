"""The Gluon small-layer kernel (libs/kernels/nvfp4/small_kernel.py) on CUDA: every token
tile it may pick against the exact product, including ragged N and M, bias, fp16, every
e4m3 scale code, and the routing that sends SmolLM2's layers to it. GPU only (`gpu`)."""

import pytest
import torch

from .nvfp4_helpers import (
    check_linear_exact,
    count_exact_on_shapes,
    cuda_weight,
    gluon_kernel,
    repeated_launches,
)

pytestmark = pytest.mark.gpu
CUDA = "cuda"
sk = gluon_kernel("small_kernel")

# the picked configs first (CONFIGS[1] is 576 x 576 at M = 256), then every other warp
# count and x path at each tile size
PICKED = [dict(BM=16, num_warps=4, X_TMA=False), dict(BM=32, num_warps=8, X_TMA=True),
          dict(BM=64, num_warps=4, X_TMA=True), dict(BM=8, num_warps=4, X_TMA=False)]
OTHERS = [dict(BM=bm, num_warps=w, X_TMA=t) for bm in (8, 16, 32, 64) for w in (4, 8)
          for t in (False, True) if bm > 8 or w == 4]  # 8-token tiles: one warpgroup
CONFIGS = PICKED + [c for c in OTHERS if c not in PICKED]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"bm{c['BM']}-w{c['num_warps']}-{'tma' if c['X_TMA'] else 'reg'}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_configs_match_exact(cfg, dtype):
    # K of 576 (SmolLM2), 64 (one chunk) and 320; N not a multiple of 64; M neither a
    # multiple of the tile nor below it, and one token; bias on odd M
    # (count_exact_on_shapes)
    shapes = ((576, 576, 256), (200, 576, 17), (192, 64, 40), (1000, 320, 2 * cfg["BM"] + 3),
              (576, 576, 1), (1536, 576, 16))
    assert count_exact_on_shapes(sk, cfg, shapes, dtype) == len(shapes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_every_scale_code_and_byte(dtype):
    packed, scales, s2 = cuda_weight(256, 576, dtype, seed=3, random_scales=True)
    assert len(set(scales.view(torch.uint8).flatten().tolist())) == 0x7F  # every finite code
    x = torch.randn(37, 576, device=CUDA).to(dtype)
    out = torch.empty(37, 256, device=CUDA, dtype=dtype)
    sk.launch(x, packed, scales, s2, None, out, CONFIGS[1])
    check_linear_exact(out, x, packed, scales, s2, None, dtype)


def test_small_is_deterministic():
    outs = repeated_launches(sk, CONFIGS[1], n=576, k=576, m=100)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_small_does_not_write_past_m_or_n():
    packed, scales, s2 = cuda_weight(100, 576, torch.bfloat16, seed=5)
    x = torch.randn(20, 576, device=CUDA, dtype=torch.bfloat16)
    big = torch.full((40, 128), 7.0, device=CUDA, dtype=torch.bfloat16)
    out = big[:20, :100]  # row stride 128: anything written past n or m shows in big
    sk.launch(x, packed, scales, s2, None, out, CONFIGS[0])
    assert (big[20:] == 7).all() and (big[:, 100:] == 7).all()
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


def test_small_misaligned_x_goes_through_registers():
    # a view starting one element into its rows: TMA cannot read it, the register path can
    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=6)
    wide = torch.randn(256, 584, device=CUDA, dtype=torch.bfloat16)
    x = wide[:, 1:577]
    assert not sk._tma_ready(x) and sk._tma_ready(wide[:, :576])
    out = torch.full((256, 576), float("nan"), device=CUDA, dtype=torch.bfloat16)
    sk.launch(x, packed, scales, s2, None, out, CONFIGS[1])
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


def test_fits_and_pick_config():
    assert sk.fits(17, 576, {}) and sk.fits(300, 64, {})
    assert not sk.fits(17, 640, {}) and not sk.fits(17, 200, {})  # past MAX_K, ragged K
    assert sk.pick_config(256, 576, 576) == PICKED[1]  # 72 programs
    assert sk.pick_config(256, 1536, 576) == PICKED[2]  # 96 programs
    # up to 64 tokens, 8-token tiles while they fit in one wave
    assert sk.pick_config(1, 576, 576) == sk.pick_config(64, 576, 576) == PICKED[3]
    assert sk.pick_config(16, 1536, 576) == sk.pick_config(32, 1536, 576) == PICKED[3]
    assert sk.pick_config(64, 1536, 576) == PICKED[0]  # 192 programs at 8 tokens
    assert sk.pick_config(128, 192, 576) == PICKED[0]  # past 64 tokens: 16 and more
    assert sk.pick_config(256, 576, 1536) is None  # K = 1536: linear_kernels
    assert sk.pick_config(1024, 1536, 576) is None  # more than one wave even at BM = 64
    assert sk.pick_config(256, 4096, 4096) is None  # large layers: gemm_kernel


def test_linear_routes_smollm2_layers_here():
    from libs.kernels import nvfp4_linear
    from libs.kernels.nvfp4 import linear_kernels as lk

    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=8)
    x = torch.randn(100, 576, device=CUDA, dtype=torch.bfloat16)
    out = torch.empty(100, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "small"
    assert lk.route(x[:1], packed, scales, out[:1])[0] == "small"
    down, down_scales, _ = cuda_weight(576, 1536, torch.bfloat16, seed=9)
    x_down = torch.randn(100, 1536, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_down, down, down_scales, out)[0] == "triton"
    x_down = torch.randn(256, 1536, device=CUDA, dtype=torch.bfloat16)
    out_down = torch.empty(256, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_down, down, down_scales, out_down)[0] == "gemm"  # 129-256 tokens
    check_linear_exact(nvfp4_linear(x, packed, scales, s2), x, packed, scales, s2, None,
                       torch.bfloat16)
