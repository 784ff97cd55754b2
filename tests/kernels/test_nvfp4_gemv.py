"""The Gluon GEMV (libs/kernels/nvfp4/gemv_kernel.py) on CUDA: every config it may be given
against the exact product, including ragged N, clamped tokens, bias, fp16, split-K and
every e4m3 scale code. GPU only (marked `gpu`)."""

import re

import pytest
import torch

from .nvfp4_helpers import GEMV_RAGGED as RAGGED
from .nvfp4_helpers import GEMV_SLICED as SLICED
from .nvfp4_helpers import GEMV_X_SMEM as X_SMEM
from .nvfp4_helpers import (
    check_linear_exact,
    count_exact_on_shapes,
    cuda_weight,
    gluon_kernel,
    repeated_launches,
)

pytestmark = pytest.mark.gpu
CUDA = "cuda"
gk = gluon_kernel("gemv_kernel")

CONFIGS = [
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, num_warps=4),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=4, num_warps=4),
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=2, num_warps=8),
    dict(BN=128, BM=8, NBYTES=16, SPLIT_K=2, num_warps=4),
    dict(BN=64, BM=8, NBYTES=32, SPLIT_K=1, num_warps=4),
    dict(BN=64, BM=8, NBYTES=16, SPLIT_K=2, num_warps=2),
    dict(BN=128, BM=16, NBYTES=16, SPLIT_K=2, num_warps=8),
]
# fewer rows a program than BN (ROWS: the spare rows re-read the tile's last and are
# dropped): the pick's 63 and 55 on the staged form, and odd counts elsewhere
FEWER_ROWS = [
    dict(X_SMEM[0], ROWS=63),
    dict(X_SMEM[0], ROWS=55),
    dict(X_SMEM[1], ROWS=100),
    dict(CONFIGS[1], ROWS=37),
    dict(CONFIGS[2], ROWS=127),
]


@pytest.mark.parametrize("cfg", CONFIGS + SLICED + X_SMEM,
                         ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_configs_match_exact(cfg, dtype):
    # N not a multiple of the program's rows; one token (with a bias) on every config
    shapes = ((384, 2048, 1), (200, 4096, 3), (1000, 2048, cfg["BM"]), (64, 8192, 2),
              (1000, 8192, 1), (40, 4096, 1))
    ran = count_exact_on_shapes(gk, cfg, shapes, dtype)
    assert ran >= 2, cfg  # every config meets at least two of the shapes


@pytest.mark.parametrize("cfg", X_SMEM, ids=["split4", "split1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_staged_x_of_any_chunk_count_matches_exact(cfg, dtype):
    # chunks per split that are not a power of two (56, 12, 28: the staging's last copies
    # are masked), the most it stages (64) and the fewest (4: 8 warps copy 4 bytes a
    # thread); ragged N, a bias (one token)
    shapes = ((100, 7168, 1), (300, 1536, 1), (200, 14336, 1), (64, 8192, 1), (72, 28672, 1),
              (96, 512, 1))
    ran = count_exact_on_shapes(gk, cfg, shapes, dtype)
    assert ran >= 3, cfg


@pytest.mark.parametrize("cfg", FEWER_ROWS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_fewer_rows_a_program_match_exact_and_the_full_tiles(cfg, dtype):
    # N ragged against both BN and ROWS, a bias on one token; then bit-equal to the same
    # config with full tiles (every output row's sum is computed the same way)
    shapes = ((1000, 2048, 1), (200, 4096, 3), (130, 8192, 1), (64, 28672, 1))
    ran = count_exact_on_shapes(gk, cfg, shapes, dtype)
    assert ran >= 2, cfg
    full = {key: v for key, v in cfg.items() if key != "ROWS"}
    packed, scales, s2 = cuda_weight(1000, 8192, dtype, seed=11)
    x = torch.randn(1, 8192, device=CUDA).to(dtype)
    outs = []
    for c in (cfg, full):
        out = torch.full((1, 1000), float("nan"), device=CUDA, dtype=dtype)
        gk.launch(x, packed, scales, s2, None, out, c)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("cfg", RAGGED, ids=lambda c: f"split{c['SPLIT_K']}-w{c['num_warps']}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_ragged_k_matches_exact(cfg, dtype):
    # 86 chunks (Llama-2-7B's 11008) over 8 splits of 10-11, 33 over 3, 5 over 1; K in
    # whole groups too; N ragged, bias on odd M, the last row read to its end
    shapes = ((300, 11008, 1), (64, 4224, 5), (1000, 640, 8), (384, 2048, 2))
    ran = count_exact_on_shapes(gk, cfg, shapes, dtype)
    assert ran >= 2, cfg


@pytest.mark.parametrize("cfg", [CONFIGS[1], SLICED[1], X_SMEM[0]],
                         ids=["split", "sliced", "staged-x"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_every_scale_code_and_byte(cfg, dtype):
    packed, scales, s2 = cuda_weight(256, 4096, dtype, seed=3, random_scales=True)
    m = 1 if cfg.get("SLICES") or cfg.get("X_SMEM") else 5
    x = torch.randn(m, 4096, device=CUDA).to(dtype)
    out = torch.empty(m, 256, device=CUDA, dtype=dtype)
    gk.launch(x, packed, scales, s2, None, out, cfg)
    check_linear_exact(out, x, packed, scales, s2, None, dtype)


@pytest.mark.parametrize("cfg", [CONFIGS[1], SLICED[0], X_SMEM[0], FEWER_ROWS[0]],
                         ids=["split", "sliced", "staged-x", "fewer-rows"])
def test_gemv_is_deterministic_and_leaves_counters_clean(cfg):
    outs = repeated_launches(gk, cfg, n=512, k=4096, m=1)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("cfg", [CONFIGS[0], SLICED[1], X_SMEM[0], FEWER_ROWS[3]],
                         ids=["split", "sliced", "staged-x", "fewer-rows"])
def test_gemv_does_not_write_past_m_or_n(cfg):
    m = 1 if cfg.get("SLICES") or cfg.get("X_SMEM") else 3
    packed, scales, s2 = cuda_weight(100, 2048, torch.bfloat16, seed=5)
    x = torch.randn(m, 2048, device=CUDA, dtype=torch.bfloat16)
    big = torch.full((8, 128), 7.0, device=CUDA, dtype=torch.bfloat16)
    out = big[:m, :100]  # row stride 128: anything written past n or m shows in big
    gk.launch(x, packed, scales, s2, None, out, cfg)
    assert (big[m:] == 7).all() and (big[:, 100:] == 7).all()
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


@pytest.mark.parametrize("cfg", [CONFIGS[1], SLICED[0], X_SMEM[0], RAGGED[1]],
                         ids=["split", "sliced", "staged-x", "ragged"])
def test_gemv_loads_only_the_weight_words_evict_first(cfg):
    """The words are read once and marked evict_first (_load_words); the scale pairs, each
    sector read by four chunks' loads, are not (marked too, they measured slower)."""
    m = 1 if cfg.get("SLICES") or cfg.get("X_SMEM") else 3
    k = 128 * 4 * 3 if cfg.get("RAGGED") else 4096
    count_exact_on_shapes(gk, cfg, ((256, k, m),), torch.bfloat16)
    entries = gk._LAUNCHES.entries.items()
    assert entries
    # launch()'s static key ends with (.., pf, x_smem, kcs); this config without PF takes
    # L2_PREFETCH, or no hint where its loads are masked (RAGGED)
    assert any(key[-3] == (0 if cfg.get("RAGGED") else gk.L2_PREFETCH)
               for (_, key, _), _ in entries)
    for (_, key, _), (compiled, _) in entries:
        loads = [line for line in compiled.asm["ptx"].splitlines() if "ld.global" in line]
        marked = [line for line in loads if "evict_first" in line]
        assert len(marked) >= 8 and all(".v4.b32" in line for line in marked), marked
        assert not any(".b16" in line for line in marked)  # the scale pairs
        hinted = [line for line in marked if f".L2::{key[-3]}B." in line]
        assert len(hinted) == (len(marked) if key[-3] else 0), marked


@pytest.mark.parametrize("pf", [64, 128, 256])
@pytest.mark.parametrize("cfg", [CONFIGS[1], SLICED[0], FEWER_ROWS[0], CONFIGS[6]],
                         ids=["split", "sliced", "staged-x-rows", "16-tokens"])
def test_gemv_l2_prefetch_hint_is_on_the_word_loads_and_changes_no_bit(cfg, pf):
    """PF puts an L2 prefetch size on the 16-byte word loads (_load_words' inline PTX; a
    config without PF takes L2_PREFETCH): the same words into the same registers, so
    outputs bit-equal to the plain loads' (PF 0)."""
    m = 1 if cfg.get("SLICES") or cfg.get("X_SMEM") else 5
    hinted = dict(cfg, PF=pf)
    assert count_exact_on_shapes(gk, hinted, ((256, 4096, m), (200, 8192, m)),
                                 torch.bfloat16) == 2
    packed, scales, s2 = cuda_weight(300, 4096, torch.float16, seed=3)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.float16)
    plain = gk.launch(x, packed, scales, s2, None,
                      torch.empty(m, 300, device=CUDA, dtype=x.dtype), dict(cfg, PF=0))
    out = gk.launch(x, packed, scales, s2, None,
                    torch.empty(m, 300, device=CUDA, dtype=x.dtype), hinted)
    assert torch.equal(out, plain)
    ptx = [compiled.asm["ptx"] for (_, key, _), (compiled, _) in gk._LAUNCHES.entries.items()
           if key[-3] == pf]  # launch()'s static key ends with (.., pf, x_smem, kcs)
    hint = f"ld.global.L1::evict_first.L2::{pf}B.v4.b32"
    assert ptx and all(text.count(hint) >= 8 for text in ptx)


@pytest.mark.parametrize("cfg", X_SMEM, ids=["split4", "split1"])
def test_gemv_stages_x_by_cp_async_behind_the_first_weight_loads(cfg):
    """x comes into shared memory by cp.async (_stage_x), and a program waits for it
    (_wait_x) only after issuing its first weight loads: x staged through registers first
    made the start one or two latencies longer (session `timelines`)."""
    count_exact_on_shapes(gk, cfg, ((256, 4096, 1),), torch.bfloat16)
    entries = gk._LAUNCHES.entries.items()
    # launch()'s static key ends with (.., x_smem, kcs)
    staged = [compiled.asm["ptx"] for (_, key, _), (compiled, _) in entries if key[-2]]
    assert staged
    for text in staged:
        lines = text.splitlines()
        copies = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.c[ag]\.", line)]
        wait = [i for i, line in enumerate(lines) if "cp.async.wait_group" in line]
        words = [i for i, line in enumerate(lines)
                 if "ld.global" in line and "evict_first" in line]
        assert copies and len(wait) == 1 and len(words) >= 8
        # every copy, then the first group's word loads (w0..w3), then the wait
        assert max(copies) < min(words) and sum(i < wait[0] for i in words) >= 8


def test_linear_uses_the_gemv_only_on_views_it_can_read():
    # nvfp4_linear hands M = 1 on this layer to the GEMV when the weight bytes can be read as
    # int32 words; a weight starting 2 bytes into a buffer cannot, and takes the Triton
    # kernel instead. Both must hold the bound.
    from libs.kernels import nvfp4_linear

    n, k = 2048, 4096
    packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=6)
    assert gk.pick_config(1, n, k) is not None and gk.viewable(packed, scales)
    buf = torch.empty(packed.numel() + 2, dtype=torch.uint8, device=CUDA)
    shifted = buf[2:].view(n, k // 2)
    shifted.copy_(packed)
    assert not gk.viewable(shifted, scales)
    x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
    for p in (packed, shifted):
        check_linear_exact(nvfp4_linear(x, p, scales, s2), x, p, scales, s2, None, torch.bfloat16)
