"""The greedy argmax kernels against torch.argmax: the same index on every row, ties,
infinities and NaNs included. Run compiled where there is a GPU, else under Triton's
interpreter in a subprocess (tests/kernels/interpreted.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.interpreted import (  # noqa: E402
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels,
    run_module_interpreted,
)

if CUDA or INTERPRETED:
    from libs.kernels import argmax as am


def test_kernels_under_the_interpreter():
    run_module_interpreted(__file__)


def _rows(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    # few distinct values: many ties, across chunks and within one
    x[1::3] = torch.randint(0, 4, (len(range(1, rows, 3)), n), generator=g).float()
    return x.to(dtype)


@kernels
@pytest.mark.gpu
@pytest.mark.gpu_smoke  # compiled on a GPU in the smoke tier
@pytest.mark.parametrize("n", [1, 5, 2048, 5000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs(n, dtype):
    x = _rows(7, n, dtype, seed=n).to(DEVICE)
    assert torch.equal(am.argmax(x), x.argmax(-1))


@kernels
@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_infinities_nans_and_a_row_of_minus_infinity():
    n = 9000
    x = torch.randn(6, n)
    x[0] = float("-inf")  # all -inf: torch says 0
    x[1, 7000] = float("inf")
    x[1, 8000] = float("inf")  # the first +inf wins
    x[2, 6000] = float("nan")
    x[2, 100] = float("inf")  # a NaN beats +inf, even later in the row
    x[3, 4100], x[3, 50] = float("nan"), float("nan")  # the first NaN
    x[4, :4096] = float("-inf")  # a whole chunk of -inf before the maximum
    x[5, -1] = 100.0  # the very last index
    x = x.to(DEVICE)
    got, want = am.argmax(x), x.argmax(-1)
    assert torch.equal(got, want), (got, want)
    assert got.tolist()[:4] == [0, 7000, 6000, 50]


@kernels
def test_many_rows_cut_into_fewer_chunks():
    x = _rows(300, 3000, torch.float32, seed=2).to(DEVICE)
    assert am.chunks_for(300, 3000, 132) == 1
    assert am.chunks_for(1, 128256, 132) > 32  # one row spreads over the GPU
    assert torch.equal(am.argmax(x), x.argmax(-1))


@kernels
def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="contiguous rows"):
        am.argmax(torch.zeros(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="float"):
        am.argmax(torch.zeros(2, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="1 <= V"):
        am.argmax(torch.zeros(2, 0, device=DEVICE))
