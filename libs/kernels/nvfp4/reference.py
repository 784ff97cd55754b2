"""Torch reference for NVFP4: bit-exact with ModelOpt's checkpoint export.

Matched against NVIDIA Model Optimizer 0.47.0 (PyPI `nvidia-modelopt`),
`modelopt/torch/quantization/qtensor/nvfp4_tensor.py` (class NVFP4QTensor and
`_cast_per_block_scale_to_fp8`), with `reduce_amax` / `reduce_block_amax` from
`modelopt/torch/quantization/utils.py` and E2M1_MAX = 6, E4M3_MAX = 448 from
`modelopt/torch/utils/numeric_utils.py`; bench/nvfp4_crosscheck.py compares the bytes.

- get_weights_scaling_factor_2: `s2 = amax(|x|).float() / (6.0 * 448.0)`, one fp32 division
  by 2688.
- get_weights_scaling_factor: `s_b = amax_b.float() / (6.0 * s2)`: the fp32 product 6*s2
  is rounded first, then one IEEE division (not `amax_b / 6 / s2`, which torchao uses).
  Scales that are exactly 0 become 1.0, then `_cast_per_block_scale_to_fp8` clamps to
  [2^-9, 448] and casts to float8_e4m3fn (round to nearest even; the clamp matters because
  torch's cast is not saturating: 464 and above would become NaN). Some ModelOpt sources
  cast without the clamp; the bytes here are 0.47.0's.
- quantize: `y = x / (fp32(s_b) * s2)`: ModelOpt DIVIDES by the rounded fp32 product; it
  does not multiply by a reciprocal. x is promoted to fp32 first (exact for bf16/fp16).
- _cast_fp4: round to nearest even on the E2M1 grid (searchsorted on the midpoints, ties at
  0.75, 1.75, 3.5 pushed up), anything above 5 saturates to 6, sign bit = `y < 0`.
- pack: `byte = code[2i] | code[2i+1] << 4`.
- dequantize: `e2m1(code) * (fp32(s_b) * s2)` in fp32, then cast to the output dtype.

Where this deliberately differs from ModelOpt:
- amax == 0 (all-zero tensor): ModelOpt gets s2 = 0 and then 0/0 = NaN block scales; we use
  s2 = 1.0 (also if amax / 2688 underflows to 0 in fp32), so every block stores 1.0 (0x38).
- 0x8 decodes to -0.0 here (the format's negative zero); ModelOpt's table decodes it to
  +0.0. The two compare equal.
Same as ModelOpt, and worth knowing: the input -0.0 encodes as 0x0 (`y < 0` is false for
it), while a negative value that rounds to zero encodes as 0x8.
"""

import torch

from .format import BLOCK, E2M1_GRID, E2M1_MAX, E4M3_MAX, E4M3_MIN, GLOBAL_DIVISOR

# Midpoints between neighbouring grid values. A magnitude exactly on a midpoint goes to the
# neighbour with the even code: up after the odd-indexed midpoints (0.75, 1.75, 3.5).
_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip(E2M1_GRID, E2M1_GRID[1:], strict=False))


def global_scale(x: torch.Tensor) -> torch.Tensor:
    """Decode-form per-tensor scale s2 = amax / 2688 (fp32, 0-d); 1.0 when that is 0."""
    amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    return global_scale_from_amax(amax)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """s2 = amax / 2688 elementwise (fp32 amax, any shape: one per tensor of a batch), 1.0
    where that is 0."""
    # Divide by a tensor, not a Python number: on CUDA, torch turns division by a Python
    # scalar into a multiplication by its rounded reciprocal, which can differ from the IEEE
    # quotient (and from the CPU) in the last bit. On the CPU both forms are the same.
    s2 = amax / amax.new_full((), GLOBAL_DIVISOR)
    return torch.where(s2 > 0, s2, 1.0)


def block_scales(x: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Per-block e4m3 scales [..., K/16] so that each block's amax maps to 6 * s_b * s2."""
    amax_b = x.unflatten(-1, (-1, BLOCK)).abs().amax(-1).float()
    s_b = amax_b / (E2M1_MAX * s2)
    s_b = torch.where(s_b == 0, 1.0, s_b)  # all-zero block: any scale works, store 1.0
    return s_b.clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)  # clamp: cast isn't saturating


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> E2M1 codes (uint8, 0..15)."""
    mag = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, mid in enumerate(_MIDPOINTS):
        code += (mag >= mid) if i % 2 else (mag > mid)  # saturates: |y| > 5 -> code 7 (6.0)
    return code | ((y < 0).to(torch.uint8) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 0 in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> fp32 values; 0x8 is -0.0."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    table = torch.cat((grid, -grid))
    return table[codes.long()]


def quantize(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], scales e4m3 [..., K/16]) for a given s2."""
    scales = block_scales(x, s2)
    per_block = scales.float() * s2  # rounded in fp32 once, as ModelOpt does
    y = x.float().unflatten(-1, (-1, BLOCK)) / per_block.unsqueeze(-1)  # IEEE division
    return pack(encode_e2m1(y.flatten(-2))), scales


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed, scales, s2) -> [..., K] in `dtype`, computed in fp32 and cast once."""
    values = decode_e2m1(unpack(packed)).unflatten(-1, (-1, BLOCK))
    per_block = scales.float() * s2
    return (values * per_block.unsqueeze(-1)).flatten(-2).to(dtype)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    s2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Weight-only y = x @ W.T + bias: W is dequantized (fp32, then cast to x.dtype) and the
    matmul runs in x.dtype, like a bf16 layer whose weights happen to be the FP4 values.
    Activations are never quantized (W4A16, how Hopper serves NVFP4)."""
    w = dequantize(packed, scales, s2, x.dtype)
    return torch.nn.functional.linear(x, w, bias)
