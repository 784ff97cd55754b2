"""The routing table (libs/kernels/nvfp4/routing.py): which kernel each shape class of the
engine's and of Llama-8B-class layers goes to, and that every config a route gives is one
its kernel takes. Plain Python, so these run everywhere; that the routed kernels compute the
product is checked on the GPU (test_nvfp4_linear_gpu.py)."""

import dataclasses

import pytest
import torch

from libs.kernels.nvfp4 import (
    gemm_configs,
    gemv_configs,
    routing,
    small_configs,
    small_phased_configs,
)
from libs.kernels.nvfp4.routing import ALIGNED, route, takes_dequantize_route

from .nvfp4_helpers import CASES

BF16, FP16 = torch.bfloat16, torch.float16

# SmolLM2-135M as the engine runs it: fused q/k/v, o, fused gate/up, down
WQKV, WO, GATE_UP, DOWN = (960, 576), (576, 576), (3072, 576), (576, 1536)
# Llama-8B-class layers: fused q/k/v, o, fused gate/up, down, and two more
LARGE = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 4096),
         (8192, 28672)]
DECODE_BATCHES = [1, 2, 8, 16, 17, 32, 33, 64, 128, 256]


def kernel(n, k, m, dtype=BF16, **kw) -> str:
    return route(m, n, k, dtype, **kw)[0]


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("nk", [WQKV, WO, GATE_UP, (64, 64), (128, 64), (256, 64)], ids=str)
def test_smollm2_and_tiny_layers_with_short_k_take_the_small_kernel(nk, dtype):
    # every decode batch and prompt chunk the engine runs (the tiny model's layers too)
    for m in DECODE_BATCHES + [300, 511]:
        assert kernel(*nk, m, dtype) == "small", (nk, m)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_smollm2_down_projection(dtype):
    # up to 32 tokens the Triton kernel splits K (few_tokens); then x through a ring;
    # past the ring's one wave the GEMM
    for m in (1, 8, 16, 17, 32):
        assert kernel(*DOWN, m, dtype) == "triton", m
    for m in (33, 64, 128, 193, 256):
        assert kernel(*DOWN, m, dtype) == "small_phased", m
    assert kernel(*DOWN, 600, dtype) == "gemm"


def test_long_prompts_on_small_layers_take_the_dequantize_route_in_bf16_only():
    for nk in (WQKV, WO, GATE_UP, DOWN):
        assert kernel(*nk, 4096, BF16) == "dequantize", nk
        assert kernel(*nk, 4096, FP16) != "dequantize", nk
    assert kernel(*GATE_UP, 512, BF16) == "dequantize"
    assert kernel(*DOWN, 1024, BF16) == "dequantize"


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("nk", LARGE, ids=str)
def test_large_layers(nk, dtype):
    # a few tokens: the GEMV; 9-16: the Triton kernel; more: the GEMM, at any length
    for m in (1, 2, 8):
        assert kernel(*nk, m, dtype) == "gemv", m
    for m in (9, 16):
        assert kernel(*nk, m, dtype) == "triton", m
    for m in (17, 64, 256, 300, 1024, 8192):
        assert kernel(*nk, m, dtype) == "gemm", m


MID = [(3072, 2048), (2048, 2048), (1024, 4096)]  # Llama-3.2-1B's q/k/v and o; 2^22


@pytest.mark.parametrize("nk", MID, ids=str)
def test_mid_sized_layers(nk):
    # decode batches: the GEMV up to 8 tokens, the Triton kernel at 9-16, the GEMM after;
    # prompt chunks (256 tokens and up): dequantize + cuBLAS in bf16, the Triton kernel in
    # fp16
    for dtype in (BF16, FP16):
        for m in (1, 2, 8):
            assert kernel(*nk, m, dtype) == "gemv", m
        for m in (9, 16):
            assert kernel(*nk, m, dtype) == "triton", m
        for m in (17, 32, 64, 128, 255):
            assert kernel(*nk, m, dtype) == "gemm", m
    for m in (256, 1024, 8192):
        assert kernel(*nk, m, BF16) == "dequantize", m
        assert kernel(*nk, m, FP16) == "triton", m


def test_mid_sized_layers_token_tiles_leave_two_thirds_of_the_sms_a_tile():
    # 3072 x 2048 has 48 rows of 64: 16-token tiles to 32 tokens, then 32, 64, 128
    tiles = {m: gemm_configs.pick_config(m, 3072, 2048)["BM"] for m in (17, 32, 33, 64, 128, 129)}
    assert tiles == {17: 16, 32: 16, 33: 32, 64: 32, 128: 64, 129: 128}
    # 2048 x 2048 (32 rows): 16-token tiles to 64 tokens, then 32
    assert gemm_configs.pick_config(64, 2048, 2048)["BM"] == 16
    assert gemm_configs.pick_config(128, 2048, 2048)["BM"] == 32
    # K stays whole, and the larger x ring only where each SM runs one program
    for m in (17, 64, 128, 200):
        cfg = gemm_configs.pick_config(m, 3072, 2048)
        assert cfg["SPLIT_K"] == 1 and cfg.get("LOOKAHEAD") is True
    wide = gemm_configs.pick_config(17, 16384, 512)  # 256 rows of 64: 256 programs
    assert wide["BM"] == 32 and "LOOKAHEAD" not in wide
    assert gemm_configs.pick_config(256, 3072, 2048) is None


def test_mid_sized_layers_gemv_tiles():
    # one token: K sliced across the warps of a program; more: 64 rows on 4 warps
    one = gemv_configs.pick_config(1, 2048, 2048)
    assert one["SLICES"] == 4 and one["BN"] == 64
    few = gemv_configs.pick_config(4, 3072, 2048)
    assert (few["BN"], few["num_warps"], few["SPLIT_K"]) == (64, 4, 4)
    assert gemv_configs.pick_config(4, 4096, 4096)["BN"] == 128  # 2^24: large-layer tiles
    assert gemv_configs.pick_config(1, 2048, 2047) is None  # under 2^22 weights


def test_k_the_kernels_cannot_take_goes_to_the_triton_kernel():
    assert kernel(4096, 11008, 1) == "gemv"  # K of whole 128-wide chunks (Llama-2's)
    assert kernel(4096, 4160, 1) == "triton"  # K not whole chunks: not the GEMV
    assert kernel(72, 1040, 3) == kernel(100, 48, 7) == "triton"  # K not whole 64-wide chunks


def test_operands_the_gluon_kernels_cannot_read_go_to_the_triton_kernel():
    x_not_tma = dataclasses.replace(ALIGNED, x_tma=False)
    # small layers: x by plain loads up to 32 tokens, so the small kernel keeps them
    assert kernel(*WO, 32, ops=x_not_tma) == "small"
    assert kernel(*WO, 33, ops=x_not_tma) == "triton"
    assert kernel(*DOWN, 64, ops=x_not_tma) == "triton"
    # large layers: the GEMV reads x by plain loads; the GEMM needs TMA for all four
    assert kernel(4096, 4096, 1, ops=x_not_tma) == "gemv"
    assert kernel(4096, 4096, 256, ops=x_not_tma) == "triton"
    assert kernel(4096, 4096, 256, ops=dataclasses.replace(ALIGNED, others_tma=False)) == (
        "triton")
    assert kernel(4096, 4096, 1, ops=dataclasses.replace(ALIGNED, scale_pairs=False)) == (
        "triton")
    # a weight whose rows are not 4-byte aligned is not TMA-readable either
    words = dataclasses.replace(ALIGNED, weight_words=False, others_tma=False)
    for nk, m in ((WO, 1), (WO, 256), (DOWN, 64), ((4096, 4096), 1), ((4096, 4096), 256)):
        assert kernel(*nk, m, ops=words) == "triton", (nk, m)


def test_without_cuda_or_gluon_only_the_triton_kernel_runs():
    cpu = dataclasses.replace(ALIGNED, cuda=False)
    for nk, m in ((WO, 1), (DOWN, 64), (GATE_UP, 4096), ((4096, 4096), 1), ((4096, 4096), 256)):
        assert kernel(*nk, m, ops=cpu) == "triton", (nk, m)  # no dequantize route either
        expected = "dequantize" if (nk, m) == (GATE_UP, 4096) else "triton"
        assert kernel(*nk, m, gluon=()) == expected, (nk, m)


def test_operands_reads_the_tensors_addresses():
    x = torch.empty(4, 584, dtype=BF16)
    packed = torch.empty(8, 288, dtype=torch.uint8)
    scales = torch.empty(8, 36, dtype=torch.uint8)
    out = torch.empty(4, 8, dtype=BF16)
    ops = routing.operands(x[:, :576], packed, scales, out)
    assert ops.cuda is False and ops.weight_words and ops.scale_pairs
    assert ops.x_tma == (x.data_ptr() % 16 == 0)
    assert not routing.operands(x[:, 1:577], packed, scales, out).x_tma
    flat = torch.empty(8 * 288 + 2, dtype=torch.uint8)
    assert not routing.operands(x, flat[2:].view(8, 288), scales, out).weight_words


ENGINE_AND_LARGE = [WQKV, WO, GATE_UP, DOWN, (192, 576), (1536, 576), (64, 64), (64, 128),
                    (960, 2560), (512, 2048), (1024, 4096), (2048, 2048), (4096, 11008),
                    (1000, 8192), (72, 1040)] + LARGE
TOKENS = list(range(1, 40)) + [48, 63, 64, 65, 100, 127, 128, 129, 193, 200, 255, 256, 257,
                               300, 330, 384, 449, 500, 520, 600, 800, 1000, 1024, 2048]


@pytest.mark.parametrize("nk", ENGINE_AND_LARGE, ids=str)
def test_every_config_a_route_gives_is_one_its_kernel_takes(nk):
    n, k = nk
    for m in TOKENS:
        for dtype in (BF16, FP16):
            name, cfg = route(m, n, k, dtype)
            if name == "gemv":
                assert gemv_configs.fits(m, k, cfg), (m, cfg)
            elif name == "small":
                assert small_configs.fits(m, k, cfg) and k <= small_configs.MAX_K
                assert cfg["BN"] * 8 >= 32 * cfg["num_warps"], cfg  # a word a thread
                assert not cfg.get("X_REGS") or m <= small_configs.X_REGS_MAX_M
            elif name == "small_phased":
                assert small_phased_configs.fits(m, k, cfg), (m, cfg)
            elif name == "gemm":
                for part_m, part in ((m, cfg), (m - cfg.get("HEAD", 0), cfg.get("REST", cfg))):
                    assert gemm_configs.fits(part_m, k, part), (m, cfg)
            elif name == "triton":
                steps = -(-k // cfg["BLOCK_K"])
                assert k % cfg["BLOCK_K"] == 0 and steps % cfg["SPLIT_K"] == 0, (m, cfg)
            else:
                assert (name, cfg) == ("dequantize", {}), (m, name)


def test_small_kernel_k_bound_is_what_its_largest_tile_fits_in_shared_memory():
    # x's 128 x K tile and the decoded 64 x K weights, 2 bytes each, under 227 KB:
    # SmolLM2's 576 fits, the next 64-wide chunk does not
    assert small_configs.MAX_K == 576
    per_k = 2 * (small_configs.MAX_TILE_TOKENS + small_configs.MAX_TILE_ROWS)
    assert per_k * small_configs.MAX_K <= small_configs.SMEM_BYTES
    assert per_k * (small_configs.MAX_K + 64) > small_configs.SMEM_BYTES
    assert small_configs.fits(1, 576, {}) and not small_configs.fits(1, 640, {})
    # and no config past it: the largest tile is the one the bound assumes
    for m in (1, 64, 65, 256, 4096):
        for n in (64, 576, 3072, 7000):
            cfg = small_configs.pick_config(m, n, 576)
            if cfg:
                tokens = 16 * cfg["num_warps"]
                assert tokens <= small_configs.MAX_TILE_TOKENS
                assert cfg["BN"] <= small_configs.MAX_TILE_ROWS


def test_phased_rings_fit_beside_the_decoded_weights():
    for k in (768, 1024, 1280, 1536, 2048):
        for bn in (16, 24, 32):
            for one_box in (True, False):
                if small_phased_configs.fits(64, k, dict(BN=bn)):
                    slots = small_phased_configs.ring_slots(k, bn, one_box)
                    assert slots >= small_phased_configs.XS
                    assert (small_phased_configs._shared_bytes(bn, k, slots)
                            <= small_phased_configs.SMEM_BYTES)


def test_gemm_copies_x_only_under_one_large_tile_and_moves_the_last_tile_past_one():
    tile = gemm_configs.pick_config(100, 4096, 4096)
    assert tile["BM"] == 128 and gemm_configs.needs_pad(100, tile)
    assert not gemm_configs.needs_pad(200, gemm_configs.pick_config(200, 4096, 4096))
    assert gemm_configs.shifts(200, dict(BM=128)) and not gemm_configs.shifts(256, dict(BM=128))
    small_tile = gemm_configs.pick_config(20, 4096, 4096)
    assert small_tile["BM"] == 32 and not gemm_configs.needs_pad(20, small_tile)
    two = gemm_configs.pick_config(300, 8192, 2048)
    assert two["HEAD"] == 256 and gemm_configs.head_config(two) == gemm_configs.pick_config(
        256, 8192, 2048)
    assert not gemm_configs.needs_pad(300, two)


@pytest.mark.parametrize("kernel_name, m, n, k, takes", [
    # SmolLM2's layers on both sides of the rule, with the kernel the route picks there
    ("small", 512, 3072, 576, True), ("small", 256, 3072, 576, False),   # fused gate_up
    ("small", 1024, 960, 576, True), ("small", 512, 960, 576, False),    # fused wqkv
    ("small", 2048, 576, 576, True), ("small", 1024, 576, 576, False),   # wo
    ("gemm", 1024, 576, 1536, True), ("gemm", 512, 576, 1536, False),    # down
    ("gemm", 1024, 2048, 1536, True), ("gemm", 512, 2048, 1536, False),
    # the Triton kernel from 32 tokens and 2^27 multiply-adds
    ("triton", 64, 2048, 1536, True), ("triton", 32, 2048, 1536, False),
    ("triton", 128, 1024, 1024, True), ("triton", 64, 1024, 1024, False),
    # layers of 2^22 to 2^24 weights: prompt chunks, never decode batches
    ("triton", 256, 3072, 2048, True), ("gemm", 128, 3072, 2048, False),
    ("gemm", 255, 2048, 2048, False), ("triton", 256, 2048, 2048, True),
    ("triton", 4096, 2048, 4096, True), ("triton", 4096, 4096, 4096, False),
    # layers of 2^24 weights and more keep the GEMM at any length
    ("gemm", 8192, 4096, 4096, False), ("gemm", 8192, 4096, 1024, True),
    # the GEMV and the phased kernel are never replaced
    ("gemv", 1024, 4096, 4096, False), ("small_phased", 1024, 576, 1536, False),
])
def test_dequantize_rule(kernel_name, m, n, k, takes):
    assert takes_dequantize_route(kernel_name, m, n, k, BF16) is takes


def test_dequantize_rule_never_takes_fp16_or_fp32():
    for dtype in (FP16, torch.float32):
        for kernel_name in ("small", "gemm", "triton"):
            assert not takes_dequantize_route(kernel_name, 8192, 3072, 576, dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}x{}-m{}-{}".format(*c))
def test_the_gpu_cases_route_where_they_say(case):
    """Each case of the GPU suite (test_nvfp4_linear_gpu.py) names the row class it covers:
    check the name here, on every machine, so a case that drifted into another class is
    caught before a GPU runs it."""
    n, k, m, kernel = case
    assert route(m, n, k, BF16, 132)[0] == kernel


def test_llama3_prompt_chunks_never_run_a_kernel_slower_than_cublas_in_bf16():
    """Every Llama-3.2-1B and Llama-3-8B linear at a prompt chunk's token counts runs the
    GEMM (faster than torch's bf16 there) or dequantize + cuBLAS; decode batches up to
    128 never take the dequantize route on a layer past 2^22 weights (it would read more
    bytes than bf16 itself)."""
    from libs.engine.nvfp4 import linear_shapes
    from libs.engine.specs import random_config

    for spec in ("random:llama3-1b", "random:llama3-8b"):
        for name, (n, k) in linear_shapes(random_config(spec)).items():
            for m in (256, 512, 1024, 4096):
                assert route(m, n, k, BF16)[0] in ("gemm", "dequantize"), (spec, name, m)
            if n * k > 1 << 22:
                for m in (1, 8, 16, 32, 64, 128):
                    assert route(m, n, k, BF16)[0] != "dequantize", (spec, name, m)
