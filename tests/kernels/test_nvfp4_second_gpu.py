"""The NVFP4 entry points run on their tensors' GPU, not on the thread's current one
(libs/kernels/nvfp4/__init__.py, _on_device_of): Triton launches on the current device,
and a member started with --device cuda:1 runs its steps in worker threads whose current
device is 0. GPU only, and only where there are two GPUs."""

import pytest
import torch

from libs.kernels import dequantize_nvfp4, nvfp4_linear, quantize_nvfp4

from .nvfp4_helpers import check_linear_exact

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two GPUs"),
]


def test_entry_points_run_on_the_tensors_gpu():
    pytest.importorskip("triton")
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 576, generator=g)
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    ref_packed, ref_scales, ref_s2 = quantize_nvfp4(w)  # the torch reference, on the CPU

    packed, scales, s2 = quantize_nvfp4(w.to("cuda:1"))
    assert torch.cuda.current_device() == 0  # the call restored the thread's device
    assert packed.device == torch.device("cuda:1")
    assert torch.equal(packed.cpu(), ref_packed)
    assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
    dense = dequantize_nvfp4(packed, scales, s2, torch.bfloat16)
    assert torch.equal(dense.cpu(), dequantize_nvfp4(ref_packed, ref_scales, ref_s2,
                                                     torch.bfloat16))
    for m in (1, 3):
        out = nvfp4_linear(x[:m].to("cuda:1"), packed, scales, s2)
        assert out.device == torch.device("cuda:1")
        check_linear_exact(out, x[:m].to("cuda:1"), packed, scales, s2, None, torch.bfloat16)
    assert torch.cuda.current_device() == 0
