"""gemm_kernel's host rules (libs/kernels/nvfp4/gemm_configs.py): which config a call gets,
when it splits into two launches, whether x is copied or the last tile moves. Plain Python,
so these run everywhere; the launches themselves are tested on the GPU
(test_nvfp4_gemm.py)."""

from libs.kernels.nvfp4 import gemm_configs as gc

from .nvfp4_helpers import gemm_config as _cfg


def test_fits():
    assert gc.fits(256, 4096, _cfg(split=4)) and not gc.fits(256, 4096 + 256, _cfg(split=2))
    assert not gc.fits(256, 576, _cfg())  # K not whole 256-wide scale slots


def test_pick_config():
    big = gc.pick_config(256, 8192, 28672)
    assert (big["BM"], big["SPLIT_K"]) == (256, 1)  # 128 tiles already fill an H200
    assert (big.get("X_STEPS"), big["STAGES"], big.get("LOOKAHEAD")) == (2, 3, True)  # one per SM
    square = gc.pick_config(256, 4096, 4096)
    assert (square["BM"], square["SPLIT_K"]) == (128, 1)  # 128-token tiles fill the SMs
    assert (square["STAGES"], square.get("LOOKAHEAD")) == (4, True)  # room for four x slots
    narrow = gc.pick_config(256, 2048, 8192)
    assert (narrow["BM"], narrow["SPLIT_K"]) == (256, 4)  # 32 tiles either way: split K
    assert gc.pick_config(100, 4096, 4096)["BM"] == 128
    # 192 tiles of 256 tokens: K halves fill the second wave, where K is 8192 or more
    assert [gc.pick_config(520, 4096, k, 132)["SPLIT_K"] for k in (4096, 8192, 14336)] == [
        1, 2, 2]
    assert gc.pick_config(800, 4096, 14336, 132)["SPLIT_K"] == 1  # 256 tiles: 2 waves either way
    assert gc.pick_config(520, 6144, 8192, 132)["SPLIT_K"] == 1  # 288: 5 half waves against 3
    assert gc.pick_config(17, 4096, 4096)["BM"] == 32
    long = gc.pick_config(128, 8192, 28672)  # two programs per SM, splits keep 14336 of K
    assert (long["BM"], long["SPLIT_K"], long["maxnreg"]) == (128, 2, 128)
    assert long.get("X_STEPS", 1) == 1  # two programs per SM: the smaller x ring
    assert not long.get("LOOKAHEAD")  # and no read-ahead
    assert gc.pick_config(16, 8192, 28672) is None  # few tokens: the Triton kernel
    assert gc.pick_config(256, 1536, 576) is None  # K = 576: not whole slots (small_kernel)
    down = gc.pick_config(256, 576, 1536)  # SmolLM2's down projection, 129-256 tokens
    assert down == _cfg(bm=32, g=8, X_STEPS=2, LOOKAHEAD=True)
    assert gc.pick_config(128, 576, 1536) is None  # up to 128 tokens: the Triton kernel
    # prompts: 64-token tiles while they fit in one wave (9 x 14 at 896 tokens), then 128
    assert gc.pick_config(257, 576, 1536) == _cfg(bm=64, g=8, X_STEPS=2, LOOKAHEAD=True)
    assert gc.pick_config(896, 576, 1536)["BM"] == 64
    assert gc.pick_config(897, 576, 1536) == _cfg(bm=128, g=8, X_STEPS=2, LOOKAHEAD=True)
    assert gc.pick_config(8192, 576, 1536)["BM"] == 128
    assert gc.pick_config(256, 576, 1280)["G"] == 4  # K not whole 8-step slots
    assert gc.pick_config(256, 4100, 4096) is None  # N not a multiple of 8


def test_tokens_past_whole_tiles_run_as_a_second_launch_where_that_saves_a_wave():
    # 17-128 tokens past whole 256-token tiles, where the whole tiles take fewer waves (one
    # program an SM) than all of them: the pick carries HEAD and the rest's own config
    cfg = gc.pick_config(300, 8192, 2048, 132)
    assert (cfg["HEAD"], cfg["BM"], cfg["REST"]) == (256, 256, gc.pick_config(44, 8192, 2048))
    assert cfg["REST"]["BM"] == 64
    assert gc.head_config(cfg) == gc.pick_config(256, 8192, 2048)
    assert gc.pick_config(600, 8192, 2048, 132)["HEAD"] == 512
    assert gc.pick_config(600, 4096, 4096, 132)["HEAD"] == 512  # 128 programs, not 192
    for m, n, k in ((272, 8192, 2048), (450, 8192, 2048), (512, 8192, 2048),  # 16 / 194
                    (300, 4096, 4096), (800, 4096, 4096)):  # tokens past, whole tiles;
        assert "HEAD" not in gc.pick_config(m, n, k, 132)  # as many waves either way
    # the waves follow the SM count: with 264 SMs all 256 tiles fit one wave, so one launch
    assert gc.whole_tiles_first(300, 8192, 132) == 256
    assert gc.whole_tiles_first(300, 8192, 264) == 0
    # a rest under one 128-token tile has its x copied, which the pair reports
    assert not gc.needs_pad(300, cfg) and gc.needs_pad(330, gc.pick_config(330, 8192, 2048))


def test_x_is_copied_only_under_one_tile_and_the_last_tile_moves_past_one():
    big = _cfg(bm=128)
    assert gc.needs_pad(100, big) and not gc.needs_pad(128, big)
    assert not gc.needs_pad(200, big) and gc.shifts(200, big)  # past one tile: moved
    assert not gc.shifts(256, big) and not gc.shifts(100, big)  # whole tiles; one tile
    assert not gc.needs_pad(100, _cfg(bm=128, PAD_X=False))
    assert not gc.needs_pad(20, _cfg(bm=32)) and gc.needs_pad(20, _cfg(bm=32, PAD_X=True))


def test_prologue_issues_the_first_slots_only_for_short_loops():
    # steps a program: K / 64 / split
    assert gc.first_slots_early(4096 // 64)  # 4096 x 4096 at M = 256
    assert gc.first_slots_early(8192 // 64)  # 8192 x 8192: 128 steps, the longest measured gain
    assert not gc.first_slots_early(8192 // 64 + 4)
    assert not gc.first_slots_early(28672 // 64)  # 8192 x 28672 at M = 256 measured slower
    assert not gc.first_slots_early(28672 // 64 // 2)  # ... and at M = 64, split in two
