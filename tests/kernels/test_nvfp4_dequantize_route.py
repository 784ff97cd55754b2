"""The dequantize route on the GPU (routing.py's override): long prompts on small layers
in bf16 run as Triton dequantize + cuBLAS, which is reference.linear's own computation, so
its output equals the reference's bit for bit. The rule itself is tested everywhere
(test_nvfp4_routing.py); these need a GPU (`gpu`)."""

import pytest
import torch

from libs.kernels import nvfp4_linear, prepare_nvfp4_linear
from libs.kernels.nvfp4 import reference

from .nvfp4_helpers import check_linear_exact, cuda_weight

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16, FP16 = torch.bfloat16, torch.float16


@gpu
@needs_cuda
def test_gpu_route_names_it_only_where_the_rule_does():
    from libs.kernels.nvfp4 import linear

    packed, scales, _ = cuda_weight(3072, 576, BF16, seed=1)
    for m, expect in ((512, "dequantize"), (256, "small")):
        x = torch.randn(m, 576, device="cuda", dtype=BF16)
        out = torch.empty(m, 3072, device="cuda", dtype=BF16)
        assert linear.route(x, packed, scales, out)[0] == expect
    x = torch.randn(512, 576, device="cuda", dtype=FP16)
    out = torch.empty(512, 3072, device="cuda", dtype=FP16)
    assert linear.route(x, packed, scales, out)[0] != "dequantize"
    # 2048x1536: the GEMM at 512 tokens (faster there), dequantize from 1024
    packed, scales, _ = cuda_weight(2048, 1536, BF16, seed=2)
    x = torch.randn(1024, 1536, device="cuda", dtype=BF16)
    out = torch.empty(1024, 2048, device="cuda", dtype=BF16)
    assert linear.route(x[:512], packed, scales, out[:512])[0] == "gemm"
    assert linear.route(x, packed, scales, out)[0] == "dequantize"


@gpu
@needs_cuda
@pytest.mark.parametrize("n, k, shape", [
    (3072, 576, (512, 576)),       # gate_up, 2-D x
    (3000, 576, (2, 400, 576)),    # ragged N, 3-D x
    (576, 1536, (1024, 1536)),     # down (the GEMM's below 1024 tokens)
    (2048, 2048, (32, 2048)),      # the Triton kernel's from 32 tokens
    (4096, 1024, (3, 100, 1024)),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_equals_the_reference_bit_for_bit(n, k, shape, with_bias):
    from libs.kernels.nvfp4 import linear

    m = torch.Size(shape[:-1]).numel()
    x2 = torch.empty(m, k, device="cuda", dtype=BF16)
    packed, scales, s2 = cuda_weight(n, k, BF16, seed=n + k)
    assert linear.route(x2, packed, scales, torch.empty(m, n, device="cuda", dtype=BF16)) == (
        "dequantize", {})
    g = torch.Generator().manual_seed(m)
    x = torch.randn(shape, generator=g).to(BF16).cuda()
    bias = torch.randn(n, generator=g).to(BF16).cuda() if with_bias else None
    y = nvfp4_linear(x, packed, scales, s2, bias)
    assert y.shape == (*shape[:-1], n) and y.dtype == BF16
    assert torch.equal(y, reference.linear(x, packed, scales, s2, bias))
    check_linear_exact(y.reshape(m, n), x.reshape(m, k), packed, scales, s2, bias, BF16)


@gpu
@needs_cuda
def test_gpu_prepared_linear_takes_it_too():
    packed, scales, s2 = cuda_weight(960, 576, BF16, seed=3)
    f = prepare_nvfp4_linear(packed, scales, s2)
    for m in (1, 1024, 1):  # a decode plan, a long prompt, the decode plan again
        x = torch.randn(m, 576, device="cuda", dtype=BF16)
        assert torch.equal(f(x), nvfp4_linear(x, packed, scales, s2))
    assert torch.equal(f(x := torch.randn(1024, 576, device="cuda", dtype=BF16)),
                       reference.linear(x, packed, scales, s2, None))
