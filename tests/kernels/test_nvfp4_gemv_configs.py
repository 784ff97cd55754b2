"""gemv_kernel's host rules (libs/kernels/nvfp4/gemv_configs.py): whether a call fits a
config and which config a call gets. Plain Python, so these run everywhere; the launches
themselves are tested on the GPU (test_nvfp4_gemv.py)."""

from libs.kernels.nvfp4 import gemv_configs as gv

from .nvfp4_helpers import GEMV_RAGGED as RAGGED
from .nvfp4_helpers import GEMV_SLICED as SLICED
from .nvfp4_helpers import GEMV_X_SMEM

STAGED = GEMV_X_SMEM[0]  # one token, x staged: 64 rows on 4 warps, split 4


def test_fits_and_pick_config():
    cfg = dict(BN=64, BM=8, NBYTES=16, SPLIT_K=4, num_warps=4)
    assert gv.fits(1, 4096, cfg) and gv.fits(8, 2048, cfg)
    assert not gv.fits(9, 4096, cfg)  # more tokens than the MMA's N
    assert not gv.fits(1, 1024, cfg)  # K not four chunks per split
    # one token elsewhere: x staged, 64 rows on 4 warps, about four programs per SM
    # with fewer rows where some SMs would get four programs and others three
    assert gv.pick_config(1, 8192, 28672) == dict(STAGED, ROWS=63)  # 524 programs
    assert gv.pick_config(1, 28672, 8192) == dict(STAGED, SPLIT_K=1, ROWS=55)  # 522
    assert "ROWS" not in gv.pick_config(1, 24576, 8192)  # 384 programs: three at most
    assert "ROWS" not in gv.pick_config(1, 4096, 14336)  # 256 programs
    assert gv.pick_config(1, 4096, 14336) == STAGED  # past K = 8192: no slices
    assert "X_SMEM" not in gv.pick_config(1, 28672, 28672)  # 224 chunks: x not staged
    assert gv.pick_config(2, 8192, 28672) == dict(BN=128, BM=8, NBYTES=16, SPLIT_K=4,
                                                  num_warps=8)
    assert gv.pick_config(8, 4096, 4096)["SPLIT_K"] == 8
    assert gv.fits(1, 4096, STAGED) and not gv.fits(2, 4096, STAGED)  # one token only
    assert not gv.fits(1, 64 * 1024, STAGED)  # 128 chunks a split: more than it stages
    assert not gv.fits(1, 4096, dict(SLICED[1], X_SMEM=True))
    assert not gv.fits(1, 11008, dict(RAGGED[0], X_SMEM=True))
    # one token on 2048-4096 rows: K sliced across the warps
    assert gv.pick_config(1, 4096, 4096) == SLICED[4]  # 32 rows a program from 3072 rows
    assert gv.pick_config(1, 3072, 4096) == SLICED[4]
    assert gv.pick_config(1, 2048, 4096) == SLICED[0]  # 16 rows: 128 programs, not 64
    assert gv.pick_config(1, 4096, 2048) == SLICED[2]  # 2048 is not 8 slices of 512
    assert gv.pick_config(1, 2048, 6144) == SLICED[1]  # nor is 6144; 16 rows under 3072
    assert gv.pick_config(1, 3072, 6144) == SLICED[1]  # 16 rows: slices of three groups
    # K = 8192: staged x split 8 ways or more beats the slices
    assert gv.pick_config(1, 4096, 8192) == dict(STAGED, SPLIT_K=8, ROWS=63)
    assert gv.pick_config(1, 2048, 8192) == dict(STAGED, SPLIT_K=16, ROWS=63)
    assert gv.pick_config(1, 4096, 6144) == SLICED[1]  # staged x would split only 4 ways
    assert "SLICES" not in gv.pick_config(1, 8192, 8192)  # 512 programs: split K
    assert "SLICES" not in gv.pick_config(2, 4096, 4096)
    assert gv.fits(1, 4096, SLICED[0]) and not gv.fits(2, 4096, SLICED[0])
    assert not gv.fits(1, 2048, SLICED[0])  # 8 slices of 256: not four chunks each
    assert gv.pick_config(9, 4096, 4096) is None  # more tokens: linear_kernels
    assert gv.pick_config(1, 576, 1536) is None  # small layers: linear_kernels
    assert gv.pick_config(1, 4096, 4160) is None  # K not whole chunks of 128
    assert gv.pick_config(1, 4096, 11008) == RAGGED[0]  # 86 chunks: uneven splits
    assert gv.fits(1, 640, RAGGED[2]) and not gv.fits(1, 640, RAGGED[1])  # 5 chunks, 3 splits
    assert not gv.fits(1, 4160, RAGGED[2])
