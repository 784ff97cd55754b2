"""Every routed shape class of nvfp4_linear on CUDA (routing.py's table): the tensors route
where the table says, and the kernel computes the product within its bound of the exact
one (check_linear_exact), or on the dequantize route equals reference.linear bit for bit;
the same bits on a second call and through prepare_nvfp4_linear. Also per kernel: every
e4m3 scale code and packed byte, split-K counters left clean, no write outside the output,
operands the Gluon kernels cannot read. GPU only (`gpu`).

Run on one GPU: pytest -m gpu tests/kernels/test_nvfp4_linear_gpu.py
"""

import pytest
import torch

from libs.kernels import nvfp4_linear, prepare_nvfp4_linear
from libs.kernels.nvfp4 import reference

from .nvfp4_helpers import CASES, check_linear_exact, cuda_module, cuda_weight, offset_rows

pytestmark = pytest.mark.gpu
linear = cuda_module("linear")
from libs.kernels import split_counters  # noqa: E402
from libs.kernels.nvfp4 import common, routing  # noqa: E402  (after the skip)

BF16, FP16 = torch.bfloat16, torch.float16



def _id(case):
    return "{}x{}-m{}-{}".format(*case)


def check_product(y, x, packed, scales, s2, bias, dtype, routed: str) -> None:
    """y is x @ W.T + bias as the route computes it: on the dequantize route
    reference.linear's output bit for bit, on a kernel's within its bound of the exact
    product."""
    if routed == "dequantize":
        assert torch.equal(y, reference.linear(x, packed, scales, s2, bias))
    else:
        check_linear_exact(y, x, packed, scales, s2, bias, dtype)


def _smoke_first_of_each_kernel(cases):
    """The cases, the first of each kernel marked gpu_smoke: the smoke tier runs every
    routed kernel once."""
    seen = set()
    out = []
    for case in cases:
        marks = [] if case[3] in seen else [pytest.mark.gpu_smoke]
        seen.add(case[3])
        out.append(pytest.param(case, marks=marks, id=_id(case)))
    return out


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", _smoke_first_of_each_kernel(CASES))
def test_every_route_computes_the_product(case, dtype):
    n, k, m, kernel = case
    packed, scales, s2 = cuda_weight(n, k, dtype, seed=n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    bias = torch.randn(n, generator=g).to(dtype).cuda() if m % 2 else None
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    routed = linear.route(x, packed, scales, out)[0]
    if (dtype is BF16 and common.sm_count(x.device) == 132
            and linear.gluon_kernels() == routing.GLUON_KERNELS):
        assert routed == kernel
    assert dtype is BF16 or routed != "dequantize"
    y = nvfp4_linear(x, packed, scales, s2, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    check_product(y, x, packed, scales, s2, bias, dtype, routed)
    assert torch.equal(nvfp4_linear(x, packed, scales, s2, bias), y)  # deterministic
    f = prepare_nvfp4_linear(packed, scales, s2, bias)
    for _ in range(2):  # the planning call, then the replay
        assert torch.equal(f(x), y)
    # leading dimensions: the engine's [B, T, K]
    x3 = x.view(1, m, k)
    assert torch.equal(nvfp4_linear(x3, packed, scales, s2, bias), y.view(1, m, n))


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("case", [
    (2048, 4096, 1), (2048, 4096, 5),  # gemv: sliced, split K
    (256, 576, 5), (256, 576, 137),  # small: registers, TMA
    (576, 1536, 64),  # small_phased
    (4096, 4096, 130), (256, 4096, 137),  # gemm: large, small-layer config
    (576, 1536, 5), (1024, 4096, 100),  # triton (fp16: 128-token tiles, plain decode)
], ids=lambda c: "{}x{}-m{}".format(*c))
def test_every_scale_code_and_byte(case, dtype):
    n, k, m = case
    packed, scales, s2 = cuda_weight(n, k, dtype, seed=3, random_scales=True)
    assert len(set(scales.view(torch.uint8)[0].tolist())) == min(k // 16, 0x7F)
    x = torch.randn(m, k, device="cuda").to(dtype)
    routed = linear.route(x, packed, scales, torch.empty(m, n, device="cuda", dtype=dtype))[0]
    y = nvfp4_linear(x, packed, scales, s2)
    check_product(y, x, packed, scales, s2, None, dtype, routed)


@pytest.mark.parametrize("case", [
    (8192, 8192, 1, "gemv"), (4096, 4096, 5, "gemv"), (576, 1536, 1, "triton"),
    (2048, 8192, 256, "gemm"), (4096, 14336, 520, "gemm"),
], ids=_id)
def test_split_k_is_deterministic_and_leaves_its_counters_clean(case):
    n, k, m, kernel = case
    packed, scales, s2 = cuda_weight(n, k, BF16, seed=4)
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    out = torch.empty(m, n, device="cuda", dtype=BF16)
    name, cfg = linear.route(x, packed, scales, out)
    split = cfg.get("SPLIT_K", 1)
    if common.sm_count(x.device) == 132:
        assert name == kernel and split > 1, cfg
    outs = [nvfp4_linear(x, packed, scales, s2) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.cuda.synchronize()
    assert all(not buf.any() for buf in split_counters._counters.values())


@pytest.mark.parametrize("case", [
    (2100, 4096, 1), (2100, 4096, 3),  # gemv
    (100, 576, 20), (100, 576, 100),  # small: registers, TMA with a shifted last tile
    (100, 768, 40), (100, 768, 100),  # small_phased
    (576, 1536, 600), (4096, 4096, 70),  # gemm: small-layer config, padded x
    (100, 1536, 5), (1024, 4096, 20),  # triton
], ids=lambda c: "{}x{}-m{}".format(*c))
def test_no_write_outside_the_output(case):
    """Each routed kernel's launch into a view of a wider buffer (row stride past N, rows
    past M): nothing outside the view changes."""
    n, k, m = case
    packed, scales, s2 = cuda_weight(n, k, BF16, seed=5)
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    big = torch.full((m + 40, n + 64), 7.0, device="cuda", dtype=BF16)
    out = big[:m, :n]
    name, cfg = linear.route(x, packed, scales, out)
    assert name != "dequantize"
    linear.kernel_module(name).launch(x, packed, scales, s2, None, out, cfg)
    assert (big[m:] == 7).all() and (big[:, n:] == 7).all(), name
    check_linear_exact(out, x, packed, scales, s2, None, BF16)


def test_operands_the_gluon_kernels_cannot_read_take_the_triton_kernel():
    # x one element into its rows: not TMA-readable; a weight two bytes into its buffer:
    # not readable as words; rows only 4-byte aligned: readable, without the L2 hint
    packed, scales, s2 = cuda_weight(576, 576, BF16, seed=6)
    wide = torch.randn(256, 584, device="cuda", dtype=BF16)
    x = wide[:, 1:577]
    for xs, kernel in ((x, "triton"), (x[:3], "small"), (wide[:, :576], "small")):
        out = torch.empty(xs.shape[0], 576, device="cuda", dtype=BF16)
        assert linear.route(xs, packed, scales, out)[0] == kernel
        check_linear_exact(nvfp4_linear(xs, packed, scales, s2), xs, packed, scales, s2, None,
                           BF16)
    # (a non-contiguous weight is refused by nvfp4_linear's checks: launched directly here)
    for n, k, m, kernel in ((200, 576, 70, "small"), (200, 576, 20, "small"),
                            (200, 1536, 70, "small_phased"), (200, 1536, 32, "triton")):
        packed, scales, s2 = cuda_weight(n, k, BF16, seed=7)
        rows4 = offset_rows(packed, 4)
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        out = torch.empty(m, n, device="cuda", dtype=BF16)
        name, cfg = linear.route(x, rows4, scales, out)
        assert name == kernel
        linear.kernel_module(name).launch(x, rows4, scales, s2.float(), None, out, cfg)
        check_linear_exact(out, x, packed, scales, s2, None, BF16)
    packed, scales, s2 = cuda_weight(2048, 4096, BF16, seed=8)
    buf = torch.empty(packed.numel() + 2, dtype=torch.uint8, device="cuda")
    shifted = buf[2:].view(2048, 2048)
    shifted.copy_(packed)
    x = torch.randn(1, 4096, device="cuda", dtype=BF16)
    out = torch.empty(1, 2048, device="cuda", dtype=BF16)
    assert linear.route(x, packed, scales, out)[0] == "gemv"
    assert linear.route(x, shifted, scales, out)[0] == "triton"
    check_linear_exact(nvfp4_linear(x, shifted, scales, s2), x, packed, scales, s2, None, BF16)
