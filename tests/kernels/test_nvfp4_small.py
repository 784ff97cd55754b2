"""The Gluon small-layer kernel (libs/kernels/nvfp4/small_kernel.py) on CUDA: every tile
it may pick, with x by TMA or straight into registers (X_REGS), against the exact product,
including ragged N and M, bias, fp16, every e4m3 scale code, and the routing that sends
SmolLM2's layers to it. GPU only (`gpu`)."""

import pytest
import torch

from .nvfp4_helpers import (
    check_linear_exact,
    count_exact_on_shapes,
    cuda_weight,
    gluon_kernel,
    hinted_word_loads,
    offset_rows,
    repeated_launches,
)

pytestmark = pytest.mark.gpu
CUDA = "cuda"
sk = gluon_kernel("small_kernel")

# x by TMA: 16, 32 and 64 weight rows a program, on one warpgroup (64 tokens) or two (128)
CONFIGS = [dict(BN=bn, num_warps=w) for bn, w in ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8))]
# x straight into wgmma's A registers (picked up to 32 tokens; correct at any M)
REG_CONFIGS = [dict(BN=bn, num_warps=4, X_REGS=True) for bn in (16, 32)]


def _name(c):
    return f"bn{c['BN']}-w{c['num_warps']}" + ("-xregs" if c.get("X_REGS") else "")


@pytest.mark.parametrize("cfg", CONFIGS + REG_CONFIGS, ids=_name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_configs_match_exact(cfg, dtype):
    # K of 576 (SmolLM2), 64 (one chunk) and 320; N not a multiple of 64 or 16; M neither
    # a multiple of the token tile nor below it, and one token; bias on odd M
    # (count_exact_on_shapes)
    shapes = ((576, 576, 256), (200, 576, 17), (192, 64, 40),
              (1000, 320, 16 * cfg["num_warps"] + 3), (576, 576, 1), (1536, 576, 16),
              (200, 576, 130), (960, 576, 3), (3072, 576, 2))
    assert count_exact_on_shapes(sk, cfg, shapes, dtype) == len(shapes)


@pytest.mark.parametrize("cfg", CONFIGS[:3] + REG_CONFIGS, ids=_name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_every_scale_code_and_byte(cfg, dtype):
    packed, scales, s2 = cuda_weight(256, 576, dtype, seed=3, random_scales=True)
    assert len(set(scales.view(torch.uint8).flatten().tolist())) == 0x7F  # every finite code
    x = torch.randn(137, 576, device=CUDA).to(dtype)
    out = torch.empty(137, 256, device=CUDA, dtype=dtype)
    sk.launch(x, packed, scales, s2, None, out, cfg)
    check_linear_exact(out, x, packed, scales, s2, None, dtype)


@pytest.mark.parametrize("cfg", CONFIGS[:3] + REG_CONFIGS, ids=_name)
def test_small_is_deterministic(cfg):
    outs = repeated_launches(sk, cfg, n=576, k=576, m=100)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("m", [20, 100])  # at 100 with x by TMA, a last tile moved back
@pytest.mark.parametrize("cfg", CONFIGS[:3] + REG_CONFIGS, ids=_name)
def test_small_does_not_write_past_m_or_n(cfg, m):
    packed, scales, s2 = cuda_weight(100, 576, torch.bfloat16, seed=5)
    x = torch.randn(m, 576, device=CUDA, dtype=torch.bfloat16)
    big = torch.full((130, 128), 7.0, device=CUDA, dtype=torch.bfloat16)
    out = big[:m, :100]  # row stride 128: anything written past n or m shows in big
    sk.launch(x, packed, scales, s2, None, out, cfg)
    assert (big[m:] == 7).all() and (big[:, 100:] == 7).all()
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


@pytest.mark.parametrize("n", [576, 200], ids=["n576", "n200"])
@pytest.mark.parametrize("cfg", CONFIGS + REG_CONFIGS, ids=_name)
def test_small_epilogue_stores_whole_sectors_with_x_by_tma(cfg, n, monkeypatch):
    """With x by TMA and N a multiple of 16 the epilogue stores 16 bytes a thread (eight
    rows of a token: _store_tokens' WIDE), which fill their 32-byte sectors. X_REGS keeps
    the accumulator's 4-byte stores (at 1-16 tokens the move measured slower), and so does
    an N that is not a multiple of 16 (wide_stores: the compiler would split the 16-byte
    stores there). The output is exact either way."""
    monkeypatch.setattr(sk._LAUNCHES, "entries", {})  # this launch's compile alone
    packed, scales, s2 = cuda_weight(n, 576, torch.bfloat16, seed=6)
    x = torch.randn(100, 576, device=CUDA, dtype=torch.bfloat16)
    out = torch.empty(100, n, device=CUDA, dtype=torch.bfloat16)
    sk.launch(x, packed, scales, s2, None, out, cfg)
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)
    (compiled, _), = sk._LAUNCHES.entries.values()
    stores = [line for line in compiled.asm["ptx"].splitlines() if "st.global" in line]
    wide = [line for line in stores if "st.global.v4.b32" in line]
    assert stores
    assert len(wide) == (len(stores) if n % 16 == 0 and not cfg.get("X_REGS") else 0), stores


def test_small_misaligned_x_goes_to_the_triton_kernel_past_16_tokens():
    # a view starting one element into its rows: TMA cannot read it, plain loads can, so
    # up to 32 tokens (x through registers) it stays here and past that the Triton
    # kernel takes it
    from libs.kernels import nvfp4_linear
    from libs.kernels.nvfp4 import linear_kernels as lk

    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=6)
    wide = torch.randn(256, 584, device=CUDA, dtype=torch.bfloat16)
    x = wide[:, 1:577]
    assert not sk.readable(x, packed) and sk.readable(wide[:, :576], packed)
    assert sk.readable(x[:32], packed) and not sk.readable(x[:33], packed)
    out = torch.empty(256, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "triton"
    assert lk.route(x[:3], packed, scales, out[:3]) == ("small", REG_CONFIGS[0])
    for xs in (x, x[:3]):
        check_linear_exact(nvfp4_linear(xs, packed, scales, s2), xs, packed, scales, s2, None,
                           torch.bfloat16)


def test_fits_and_pick_config():
    assert sk.fits(17, 576, {}) and sk.fits(300, 64, {})
    assert not sk.fits(17, 640, {}) and not sk.fits(17, 200, {})  # past MAX_K, ragged K
    # up to 32 tokens x through registers, 16 rows a program while at most two a SM, then
    # 32; past that x by TMA, 16 rows a program while they fit in one wave, then 32, and
    # two warpgroups past 64 tokens where one does not fit
    assert sk.pick_config(1, 576, 576) == sk.pick_config(32, 1536, 576) == REG_CONFIGS[0]
    assert sk.pick_config(1, 4224, 576) == REG_CONFIGS[0]  # 264 programs
    assert sk.pick_config(1, 4240, 576) == REG_CONFIGS[1]  # 16 rows: 265 programs
    assert sk.pick_config(1, 8192, 512) is None  # 2^22 weights: a large layer
    assert sk.pick_config(33, 576, 576) == sk.pick_config(128, 576, 576) == CONFIGS[0]
    assert sk.pick_config(256, 192, 576) == CONFIGS[0]  # 48 programs
    assert sk.pick_config(256, 576, 576) == CONFIGS[1]  # 16 rows: 144 programs
    assert sk.pick_config(64, 1536, 576) == CONFIGS[0]  # 96 programs
    assert sk.pick_config(128, 1536, 576) == CONFIGS[1]
    assert sk.pick_config(256, 1536, 576) == CONFIGS[2]  # 192 programs on one warpgroup
    assert sk.pick_config(896, 576, 576) == CONFIGS[2]  # 18 x 7 programs
    # where 16 and 32 rows take more than a wave: 64 rows, then 64 on two warpgroups
    # in as many waves as it takes
    assert sk.pick_config(129, 2304, 576) == CONFIGS[3]  # 36 x 3 programs
    assert sk.pick_config(256, 3072, 576) == CONFIGS[4]  # the engine's gate_up: 48 x 2
    assert sk.pick_config(1024, 576, 576) == CONFIGS[4]  # 9 x 8
    assert sk.pick_config(512, 4096, 576) == CONFIGS[4]  # 64 x 4
    assert sk.pick_config(8192, 3072, 576) == CONFIGS[4]  # 48 x 64: prompts, many waves
    assert sk.pick_config(256, 576, 1536) is None  # K = 1536: linear_kernels
    assert sk.pick_config(256, 4096, 4096) is None  # large layers: gemm_kernel


def test_linear_routes_smollm2_layers_here():
    from libs.kernels import nvfp4_linear
    from libs.kernels.nvfp4 import linear_kernels as lk

    packed, scales, s2 = cuda_weight(576, 576, torch.bfloat16, seed=8)
    x = torch.randn(100, 576, device=CUDA, dtype=torch.bfloat16)
    out = torch.empty(100, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "small"
    assert lk.route(x[:1], packed, scales, out[:1]) == ("small", REG_CONFIGS[0])
    # the engine's fused gate/up at one token (the Triton kernel's before X_REGS)
    fused, fused_scales, _ = cuda_weight(3072, 576, torch.bfloat16, seed=11)
    out_fused = torch.empty(1, 3072, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x[:1], fused, fused_scales, out_fused)[0] == "small"
    # and at 256 tokens: 64 rows on two warpgroups (the Triton kernel's before)
    x_wide = torch.randn(256, 576, device=CUDA, dtype=torch.bfloat16)
    out_wide = torch.empty(256, 3072, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_wide, fused, fused_scales, out_wide) == ("small", CONFIGS[4])
    down, down_scales, _ = cuda_weight(576, 1536, torch.bfloat16, seed=9)
    x_down = torch.randn(256, 1536, device=CUDA, dtype=torch.bfloat16)
    out_down = torch.empty(256, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_down[:16], down, down_scales, out_down[:16])[0] == "triton"
    assert lk.route(x_down[:32], down, down_scales, out_down[:32])[0] == "triton"  # few_tokens
    assert lk.route(x_down[:33], down, down_scales, out_down[:33])[0] == "small_phased"
    assert lk.route(x_down, down, down_scales, out_down)[0] == "small_phased"
    # prompts: past the phased kernel's one wave the GEMM (the Triton kernel's before),
    # then in bf16 from 2^29 multiply-adds dequantize + cuBLAS (test_nvfp4_dequantize_route)
    x_long = torch.randn(1024, 1536, device=CUDA, dtype=torch.bfloat16)
    out_long = torch.empty(1024, 576, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_long[:512], down, down_scales, out_long[:512])[0] == "gemm"
    assert lk.route(x_long, down, down_scales, out_long)[0] == "dequantize"
    x_up = torch.randn(1024, 576, device=CUDA, dtype=torch.bfloat16)
    out_up = torch.empty(1024, 3072, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_up, fused, fused_scales, out_up)[0] == "dequantize"
    # fp16 keeps the kernels at any length
    assert lk.route(x_up.half(), fused, fused_scales, out_up.half()) == ("small", CONFIGS[4])
    assert lk.route(x_long.half(), down, down_scales, out_long.half())[0] == "gemm"
    wide, wide_scales, _ = cuda_weight(2048, 1536, torch.bfloat16, seed=10)
    out_wide = torch.empty(256, 2048, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x_down, wide, wide_scales, out_wide)[0] == "gemm"  # 256 programs
    check_linear_exact(nvfp4_linear(x, packed, scales, s2), x, packed, scales, s2, None,
                       torch.bfloat16)


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "offset4"])
@pytest.mark.parametrize("cfg", CONFIGS + REG_CONFIGS, ids=_name)
def test_small_word_loads_prefetch_only_where_rows_are_16_byte_aligned(cfg, offset,
                                                                        monkeypatch):
    """Rows of words that start 16-byte aligned: each chunk's word loads ask L2 for the
    128 bytes around them (words_prefetch), one vector load a thread. Rows only 4-byte
    aligned (a view into a wider buffer) would fault a vector load: plain loads there.
    Exact either way."""
    monkeypatch.setattr(sk._LAUNCHES, "entries", {})
    packed, scales, s2 = cuda_weight(200, 576, torch.bfloat16, seed=7)
    w = offset_rows(packed, offset)
    assert (sk.words_prefetch(w) > 0) == (offset == 0)
    x = torch.randn(70, 576, device=CUDA, dtype=torch.bfloat16)
    out = torch.empty(70, 200, device=CUDA, dtype=torch.bfloat16)
    sk.launch(x, w, scales, s2, None, out, cfg)
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)
    assert hinted_word_loads(sk) == (9 if offset == 0 else 0)  # one a chunk of 64
