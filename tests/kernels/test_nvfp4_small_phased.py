"""The phased small kernel (libs/kernels/nvfp4/small_phased_kernel.py): x streamed through
a ring of shared buffers, against the exact product. GPU only (`gpu`)."""

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
ph = gluon_kernel("small_phased_kernel")
BN16, BN24, BN32 = (dict(BN=bn, num_warps=4) for bn in (16, 24, 32))
CONFIGS = [BN16, BN24, BN32]  # 24: 24 rows in a 32-column tile, rows 24-31 never written


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bn{c['BN']}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_phased_matches_exact(cfg, dtype):
    # SmolLM2's down projection (K = 1536, 6 phases) at ragged and whole token counts, a
    # ragged N, and K = 768 (3 phases: the ring filled once, never refilled); bias on odd M
    # (BN = 24: 200 rows end 8 rows into a program's 16-row part, 600 on a whole program)
    shapes = ((576, 1536, 1), (576, 1536, 17), (576, 1536, 64), (576, 1536, 130),
              (576, 1536, 256), (200, 1536, 40), (200, 768, 33), (600, 1536, 224))
    assert count_exact_on_shapes(ph, cfg, shapes, dtype) == len(shapes)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"bn{c['BN']}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_phased_deep_rings(cfg, dtype):
    # five phases (K = 1280): 4 one-box slots (one refill) from 33 tokens, and at 17-32
    # tokens 5 slots of 32-row copies at 16 rows (all of K in the ring, never refilled)
    # or 4 at 32 rows (five past shared memory); bias on odd M
    shapes = ((576, 1280, 20), (576, 1280, 70), (200, 1280, 33), (200, 1280, 256))
    assert [ph.ring_slots(1280, cfg["BN"], ph.x_rows(m) == 64) for *_, m in shapes] == (
        [5 if cfg["BN"] == 16 else 4, 4, 4, 4])  # BN = 24 takes 32 rows' shared memory
    assert count_exact_on_shapes(ph, cfg, shapes, dtype) == len(shapes)


def test_phased_split_decode_rule():
    # three decode groups at 24 rows where two phases or more wait for a refill and all
    # of the first group's are in the ring at the start
    assert ph.split_decode(1536, 24, 64, 4)  # SmolLM2's down projection: 6 phases, 4 slots
    assert not ph.split_decode(1280, 24, 64, 4)  # one refilled phase: measured mixed
    assert not ph.split_decode(1536, 16, 64, 4) and not ph.split_decode(1536, 32, 64, 4)
    assert not ph.split_decode(1536, 24, 32, 5)  # 32-row boxes: nothing refilled
    assert not ph.split_decode(1792, 24, 64, 3)  # 4 refilled phases, 3 slots
    assert not ph.split_decode(1024, 24, 64, 3)  # 4 phases: one refill


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_phased_split_decode_is_bit_equal(dtype):
    # the three-group decode (picked) against the whole decode up front, forced, at 24
    # rows: ragged and whole token counts, a shifted last tile, ragged N, a bias
    for n, k, m in ((576, 1536, 256), (576, 1536, 193), (600, 1536, 100), (200, 1280, 70)):
        packed, scales, s2 = cuda_weight(n, k, dtype, seed=n + m)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        outs = []
        for split in (True, False):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            ph.launch(x, packed, scales, s2, bias, out, dict(BN24, SPLIT=split))
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (n, k, m)
        check_linear_exact(outs[0], x, packed, scales, s2, bias, dtype)


# x's TMA box: 32 rows up to 32 tokens (the rows past them never written), else 64; each
# forced here at the token counts it allows, the 64-row box also where 32 would be picked
BOX_CONFIGS = [dict(BN=16, num_warps=4, XR=16), dict(BN=32, num_warps=4, XR=32),
               dict(BN=16, num_warps=4, XR=64), dict(BN=24, num_warps=4, XR=32)]


@pytest.mark.parametrize("cfg", BOX_CONFIGS, ids=lambda c: f"bn{c['BN']}-xr{c['XR']}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_phased_boxes_match_exact(cfg, dtype):
    shapes = [(576, 1536, m) for m in (1, 5, 16, 17, 31, 32)] + [(200, 768, 9)]
    shapes = [s for s in shapes if s[2] <= cfg["XR"]]
    assert count_exact_on_shapes(ph, cfg, shapes, dtype) == len(shapes)


def test_phased_box_rows():
    assert [ph.x_rows(m) for m in (1, 17, 32, 33, 64, 256)] == [32, 32, 32, 64, 64, 64]
    packed, scales, s2 = cuda_weight(576, 1536, torch.bfloat16, seed=3)
    x = torch.randn(33, 1536, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(33, 576, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(AssertionError):  # a box must hold every token of the tile
        ph.launch(x, packed, scales, s2, None, out, BOX_CONFIGS[1])


@pytest.mark.parametrize("cfg", [BN16, BN24], ids=lambda c: f"bn{c['BN']}")
@pytest.mark.parametrize("m", [20, 40, 100])
def test_phased_does_not_write_past_m_or_n(m, cfg):
    # a 32-row box at 20 tokens (rows 20..63 of the tile never loaded), a 64-row one at 40,
    # and at 100 a second tile moved back to rows 36..99 (tile_row0); at BN = 24 the last
    # program holds rows 96..99 and each program's columns 24-31 are the next one's rows
    packed, scales, s2 = cuda_weight(100, 768, torch.bfloat16, seed=5)
    x = torch.randn(m, 768, device="cuda", dtype=torch.bfloat16)
    big = torch.full((130, 128), 7.0, device="cuda", dtype=torch.bfloat16)
    out = big[:m, :100]  # row stride 128: anything written past n or m shows in big
    ph.launch(x, packed, scales, s2, None, out, cfg)
    assert (big[m:] == 7).all() and (big[:, 100:] == 7).all()
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)


@pytest.mark.parametrize("cfg", [BN16, BN24], ids=lambda c: f"bn{c['BN']}")
@pytest.mark.parametrize("m", [20, 100])  # a 32-row box, then two tiles of 64
def test_phased_is_deterministic(m, cfg):
    outs = repeated_launches(ph, cfg, n=576, k=1536, m=m)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_phased_fits():
    assert ph.fits(64, 1536, BN16) and ph.fits(64, 1536, BN24) and ph.fits(64, 1536, BN32)
    assert ph.fits(64, 768, BN16) and ph.fits(64, 768, BN24)
    assert not ph.fits(64, 512, BN16)  # two phases: fewer than the ring's slots
    assert not ph.fits(64, 1600, BN16)  # not whole phases of 256
    assert not ph.fits(64, 4096, BN32)  # 32 x 4096 x 2 bytes of weights
    assert ph.fits(64, 2048, BN16) and not ph.fits(64, 2048, BN24)  # 24 rows take 32's


def test_phased_pick_config():
    # SmolLM2's down projection: 16 rows while they fit in one wave, then 24, then 32
    assert ph.pick_config(33, 576, 1536) == ph.pick_config(128, 576, 1536) == BN16
    assert ph.pick_config(129, 576, 1536) == ph.pick_config(192, 576, 1536) == BN16  # 108
    assert ph.pick_config(193, 576, 1536) == BN24  # 16 rows: 144 programs; 24 rows: 96
    assert ph.pick_config(256, 576, 1536) == ph.pick_config(256, 576, 1280) == BN24
    assert ph.pick_config(256, 960, 1536) == BN32  # 24 rows: 160 programs; 32: 120
    assert ph.pick_config(256, 512, 2048) == BN16  # 128 programs
    assert ph.pick_config(16, 576, 1536) is None  # the Triton kernel is faster
    assert ph.pick_config(32, 576, 1536) is None  # so at K >= 1536 to 32 tokens
    assert ph.pick_config(17, 512, 2048) is None
    assert ph.pick_config(17, 576, 1280) == ph.pick_config(32, 1024, 1024) == BN16
    assert ph.pick_config(17, 960, 1536) == BN16  # the Triton kernel past one wave
    assert ph.pick_config(512, 576, 1536) is None  # past one wave at 32 rows
    assert ph.pick_config(256, 2048, 1536) is None  # 256 programs
    assert ph.pick_config(64, 4096, 4096) is None  # a large layer
    assert ph.pick_config(64, 576, 1600) is None  # K not in whole phases


def test_long_and_light_calls_go_to_the_triton_kernel():
    # K of 2048 or more at 33-128 tokens under 2^27 multiply-adds: the Triton kernel;
    # the bound itself (512 x 2048 at 128 tokens, 1024 x 2048 at 64), shorter K and more
    # tokens keep this kernel
    assert ph.long_and_light(33, 512, 2048) and ph.long_and_light(96, 512, 2048)
    assert ph.long_and_light(48, 960, 2560) and ph.long_and_light(128, 256, 2048)
    assert not ph.long_and_light(32, 512, 2048)  # few_tokens' range
    assert not ph.long_and_light(128, 512, 2048) and not ph.long_and_light(64, 1024, 2048)
    assert not ph.long_and_light(129, 256, 2048) and not ph.long_and_light(64, 960, 2560)
    assert not ph.long_and_light(48, 576, 1536) and not ph.long_and_light(100, 1024, 1792)
    assert ph.pick_config(48, 960, 2560) is None
    assert ph.pick_config(64, 960, 2560) == ph.pick_config(128, 512, 2048) == BN16
    from libs.kernels import nvfp4_linear
    from libs.kernels.nvfp4 import linear_kernels as lk

    for n, k, m, kernel in ((960, 2560, 48, "triton"), (960, 2560, 64, "small_phased"),
                            (256, 2048, 100, "triton"), (256, 2048, 129, "small_phased")):
        packed, scales, s2 = cuda_weight(n, k, torch.bfloat16, seed=13)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        assert lk.route(x, packed, scales, out)[0] == kernel, (n, k, m)
        check_linear_exact(nvfp4_linear(x, packed, scales, s2), x, packed, scales, s2, None,
                           torch.bfloat16)


def test_phased_misaligned_x_goes_to_the_triton_kernel():
    # a view one element into its rows: TMA cannot read it at any M (small_kernel reads such
    # an x with plain loads up to 32 tokens, this kernel cannot), so the Triton kernel runs
    from libs.kernels import nvfp4_linear
    from libs.kernels.nvfp4 import linear_kernels as lk

    packed, scales, s2 = cuda_weight(576, 1536, torch.bfloat16, seed=12)
    wide = torch.randn(40, 1544, device="cuda", dtype=torch.bfloat16)
    x = wide[:, 1:1537]
    assert not ph.readable(x, packed) and ph.readable(wide[:, :1536], packed)
    out = torch.empty(40, 576, device="cuda", dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "triton"
    assert lk.route(wide[:, :1536], packed, scales, out)[0] == "small_phased"
    check_linear_exact(nvfp4_linear(x, packed, scales, s2), x, packed, scales, s2, None,
                       torch.bfloat16)


@pytest.mark.parametrize("offset", [0, 4], ids=["aligned", "offset4"])
@pytest.mark.parametrize("cfg", CONFIGS + BOX_CONFIGS[:1],
                         ids=lambda c: f"bn{c['BN']}-xr{c.get('XR', 64)}")
def test_phased_word_loads_prefetch_only_where_rows_are_16_byte_aligned(cfg, offset,
                                                                         monkeypatch):
    """As small_kernel's (shared _load_rows): L2-prefetching vector loads of the words
    where their rows start 16-byte aligned, plain loads otherwise; exact either way, with
    x's boxes issued before the loads (64-token boxes) or after (16-row boxes)."""
    monkeypatch.setattr(ph._LAUNCHES, "entries", {})
    packed, scales, s2 = cuda_weight(200, 1536, torch.bfloat16, seed=13)
    w = offset_rows(packed, offset)
    m = cfg.get("XR", 70)
    x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, 200, device="cuda", dtype=torch.bfloat16)
    ph.launch(x, w, scales, s2, None, out, cfg)
    check_linear_exact(out, x, packed, scales, s2, None, torch.bfloat16)
    # one a chunk of 64; BN = 24 has one more a chunk pair for its 8 rows
    assert hinted_word_loads(ph) == (0 if offset else 36 if cfg["BN"] == 24 else 24)


def test_phased_ring_slots():
    # a deeper ring only where measured: five or six phases (K = 1280, 1536), 4 one-box
    # slots or 5 slots of 32-row copies, the most that fit beside the decoded weights;
    # the deeper kernels' exactness: test_phased_matches_exact and test_phased_deep_rings
    assert ph.ring_slots(1536, 32, True) == ph.ring_slots(1536, 16, True) == 4
    assert ph.ring_slots(1536, 24, True) == ph.ring_slots(1536, 24, False) == 4
    assert ph.ring_slots(1280, 16, True) == 4
    assert ph.ring_slots(1536, 16, False) == ph.ring_slots(1280, 16, False) == 5
    assert ph.ring_slots(1536, 32, False) == 4  # 5 slots past shared memory at 32 rows
    assert ph.ring_slots(2048, 16, True) == ph.ring_slots(2048, 16, False) == 3  # 8 phases
    assert ph.ring_slots(768, 16, True) == ph.ring_slots(1024, 16, False) == 3
    assert ph.ring_slots(1536, 64, True) == 3  # 192 KB of weights: no room
    for k, bn, one_box in [(1536, 16, False), (1536, 32, True), (1280, 32, False),
                           (1536, 24, True)]:
        assert ph._shared_bytes(bn, k, ph.ring_slots(k, bn, one_box)) <= ph.SMEM_BYTES
