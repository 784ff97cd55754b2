"""Triton (CUDA) path for NVFP4: quantize, dequantize and the weight-only linear.

Same signatures as reference.py; `libs.kernels.nvfp4._impl` sends CUDA tensors here when
triton is installed. Inputs were already validated by checks.py, so nothing is re-checked.

Numerics:
- quantize (quantize_kernel.py) and dequantize (dequantize_kernel.py) are bit-exact with
  reference.py (and so with ModelOpt): each computes the reference's IEEE fp32 values in
  the reference's order; quantize_kernel.py says how quantize does it without a division
  per element.
- linear (linear.py) is NOT bit-identical with the reference on its kernels' routes: the
  reference dequantizes W to x.dtype (one rounding of w * s2 per weight) and lets cuBLAS
  sum in its own order, where the kernels decode each weight to the exact product
  e2m1 * s_b, sum in fp32 and apply s2 once per output (common.py). Its dequantize route
  is the reference's computation, bit for bit.
"""

import torch

from .common import sm_count
from .dequantize_kernel import dequantize
from .format import BLOCK
from .grid import cdiv
from .linear import linear
from .quantize_kernel import FAST_S2_MAX, FAST_S2_MIN, quantize_kernel

__all__ = ["dequantize", "linear", "quantize"]

# quantize, per input dtype: (blocks of 16 per tile, warps, programs per SM); a thread owns
# blocks / (32 * warps) blocks of a tile. fp16 takes bf16's.
_QUANTIZE_CONFIG = {torch.float32: (256, 4, 32), torch.bfloat16: (256, 4, 32)}


def quantize(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], scales e4m3 [..., K/16]) for a given s2."""
    blocks, warps, per_sm = _QUANTIZE_CONFIG.get(x.dtype, _QUANTIZE_CONFIG[torch.bfloat16])
    return _quantize(x, s2, blocks, warps, per_sm)


def _quantize(x, s2, blocks: int, num_warps: int, programs_per_sm: int):
    k = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    n_blocks = x.numel() // BLOCK
    if n_blocks:
        programs = min(cdiv(n_blocks, blocks), sm_count(x.device) * programs_per_sm)
        fp32 = x.dtype == torch.float32
        pairs = x.dtype == torch.bfloat16  # read as int32 words (quantize_kernel._to_float)
        x = x.contiguous()  # any strides in; the kernel reads one flat run of blocks
        if pairs:
            x = (x if x.data_ptr() % 4 == 0 else x.clone()).view(torch.int32)
        quantize_kernel[(programs,)](
            x,
            packed.view(torch.int32),
            scales.view(torch.uint8),
            s2.to(device=x.device, dtype=torch.float32),
            n_blocks,
            BLOCKS=blocks,
            W=4 if fp32 else 8,
            STEPS=2 if fp32 else 1,
            PAIRS=pairs,
            FAST_S2_MIN=FAST_S2_MIN,
            FAST_S2_MAX=FAST_S2_MAX,
            num_warps=num_warps,
        )
    return packed, scales
