"""Triton (CUDA) path for NVFP4: quantize, dequantize and the weight-only linear.

Same signatures as reference.py; `libs.kernels.nvfp4._impl` sends CUDA tensors here when
triton is installed. Inputs were already validated by checks.py, so nothing is re-checked.

Numerics:
- quantize and dequantize are bit-exact with reference.py (and so with ModelOpt). Every
  step is the reference's own IEEE fp32 operation in the same order: the block amax, one
  rounded product 6 * s2, a correctly rounded division (`tl.div_rn`: Triton's plain `/` on
  fp32 is an approximate division, which differs from IEEE near E2M1 midpoints), the e4m3
  rounding (nearest even, done with integer ops, checked against torch's cast for every
  fp32 in [2^-9, 448]; the clamp to [2^-9, 448] comes first, as in the reference),
  the rounded product fp32(s_b) * s2, a second correctly rounded division per element, and
  round-to-nearest-even onto the E2M1 grid with the reference's saturation, sign rule
  (-0.0 -> 0x0, a negative value that rounds to zero -> 0x8) and NaN rule (code 0).
- linear is NOT bit-identical with the reference, which dequantizes W to x.dtype (one
  rounding of w * s2 per weight) and lets cuBLAS sum in its own order. Here each weight is
  decoded to the exact product e2m1 * s_b (at most 6 significant bits, so it fits bf16 and
  fp16 exactly after a power-of-two shift), the tensor cores sum in fp32, and s2 is applied
  once per output. See linear_kernels.py.

Speed on an H200 (bench/nvfp4_kernels_bench.py, 8192 x 8192, vs a 4.2 TB/s copy): dequantize
~91% of the copy for bf16 and fp32 output; quantize 52% (bf16 input) and 76% (fp32 input).
quantize is instruction-bound (~38 SASS instructions per element, 11 of them for the
correctly rounded division). A variant that replaced the per-element division by
comparisons with exact per-block thresholds passed every bit-exact test but measured
slower (91 vs 78 us for bf16), so the division stayed.
"""

import torch
import triton
import triton.language as tl

from .format import BLOCK, E2M1_MAX, E4M3_MAX, E4M3_MIN
from .linear_kernels import linear  # noqa: F401  (part of this module's interface)

# Blocks of 16 elements handled by one program. 128 blocks = 2048 elements: 16 per thread
# with 4 warps, so every thread issues a couple of 16-byte loads and stores.
_BLOCKS_PER_PROGRAM = 128


@triton.jit
def _encode_e2m1(y):
    """fp32 quotients -> E2M1 codes (int32 0..15), exactly reference.encode_e2m1.

    Round to nearest even on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} with integer ops on the
    fp32 bits b of |y| (counting midpoints costs more instructions, and this kernel is
    instruction-bound):
    - |y| >= 1: the grid is a float with one mantissa bit, so round b at bit 22 (ties to
      even); the rounded exponent/mantissa field minus 252 is the code, capped at 7 (the
      saturation at 6).
    - |y| < 1: the grid step is 0.5; adding 2^22 (whose fp32 ulp is 0.5) rounds |y| to a
      multiple of 0.5, ties to even, and the low bits of the sum count the halves: 0, 1
      or 2, which are the codes of 0, 0.5 and 1.
    - NaN (only from 0/0 when the per-block scale underflows) passes no midpoint in the
      reference: code 0. The sign is `y < 0`, so -0.0 gets 0x0 like the reference."""
    b = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    big = (b + 0x1FFFFF + ((b >> 22) & 1)) >> 22
    big = tl.minimum(big - 252, 7)
    small = (tl.abs(y) + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    code = tl.where(b < 0x3F800000, small, big)
    code = tl.where(b > 0x7F800000, 0, code)
    return code | tl.where(y < 0, 8, 0)


@triton.jit
def _pack_nibbles(code):
    """[R, 8] codes -> [R] int32 words: code i in bits 4i..4i+3, i.e. the 4 packed bytes
    of those 8 elements in little-endian order (element 2i in the low nibble of byte i)."""
    shifts = tl.arange(0, 8) * 4
    return tl.sum(code << shifts[None, :], axis=1)


@triton.jit
def _round_e4m3(s):
    """fp32 s in [2^-9, 448] -> (s rounded to nearest even on the e4m3 grid, as fp32; its
    float8_e4m3fn byte).

    Done with integer ops rather than Triton's fp32 -> fp8 cast so that the rounding mode is
    written here, not left to a lowering (the CPU interpreter's cast does not round).
    - s >= 2^-6 (normal e4m3, 3 mantissa bits): round the fp32 bits at bit 20, ties to even,
      and the byte is the rounded exponent/mantissa field rebiased from 127 to 7
      ((bits >> 20) - (120 << 3)). A carry into the exponent is the right answer.
    - s < 2^-6 (subnormal, steps of 2^-9): the number of steps, 1..8, is the byte itself
      (8 is 0x08 = 2^-6, the smallest normal)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    # 2^14 has an fp32 ulp of 2^-9: adding it rounds s to a multiple of 2^-9 (nearest
    # even), and the low bits of the sum count those steps.
    steps = (s + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    is_normal = s >= 0.015625
    subnormal = steps.to(tl.float32) * 0.001953125  # exact
    rounded = tl.where(is_normal, bits.to(tl.float32, bitcast=True), subnormal)
    byte = tl.where(is_normal, (bits >> 20) - 960, steps)
    return rounded, byte


@triton.jit
def _quantize_kernel(
    x_ptr,  # [n_blocks * 16] bf16/fp16/fp32, contiguous
    packed_ptr,  # [n_blocks * 2] int32 (the packed bytes, 4 per word)
    scales_ptr,  # [n_blocks] uint8 (the bytes of float8_e4m3fn)
    s2_ptr,  # 0-d fp32: decode-form global scale
    n_blocks,
    BLOCKS: tl.constexpr,
    E2M1_MAX: tl.constexpr,
    E4M3_MIN: tl.constexpr,
    E4M3_MAX: tl.constexpr,
):
    # int64 offsets: a tensor over 2^31 elements is plausible (a large weight or KV cache).
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks[:, None] < n_blocks
    # Each block is loaded as two [BLOCKS, 8] halves so that one thread owns a whole block:
    # the amax and the per-block scale math then need no shuffles and are not repeated.
    cols = tl.arange(0, 8)[None, :]
    base = x_ptr + blocks[:, None] * 16 + cols
    x0 = tl.load(base, mask=in_range, other=0.0).to(tl.float32)  # exact for bf16/fp16
    x1 = tl.load(base + 8, mask=in_range, other=0.0).to(tl.float32)
    s2 = tl.load(s2_ptr)

    # Block scale, step by step as reference.block_scales.
    amax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
    s_b = tl.div_rn(amax, E2M1_MAX * s2)  # the product 6 * s2 is rounded first
    s_b = tl.where(s_b == 0.0, 1.0, s_b)
    s_b = tl.minimum(tl.maximum(s_b, E4M3_MIN), E4M3_MAX)
    s_rounded, s_byte = _round_e4m3(s_b)

    # Elements: y = x / (fp32(s_b) * s2), a true division per element.
    per_block = (s_rounded * s2)[:, None]
    word0 = _pack_nibbles(_encode_e2m1(tl.div_rn(x0, per_block)))
    word1 = _pack_nibbles(_encode_e2m1(tl.div_rn(x1, per_block)))
    words = tl.join(word0, word1)  # [BLOCKS, 2]: the block's 8 bytes
    tl.store(packed_ptr + blocks[:, None] * 2 + tl.arange(0, 2)[None, :], words, mask=in_range)
    tl.store(scales_ptr + blocks, s_byte.to(tl.uint8), mask=blocks < n_blocks)


@triton.jit
def _decode_e2m1_scaled(byte, SHIFT: tl.constexpr, per_block):
    """One nibble of each byte (SHIFT 0: low, 4: high) -> e2m1 * per_block in fp32, with the
    reference's single rounding of that product; 0x8 -> -0.0 * per_block = -0.0.

    The code's 3 magnitude bits placed at fp32 bits 22-24 (and its sign at bit 31) ARE the
    value times 2^-126: E2M1's exponent bias is 1, and its subnormal (code 1 = 0.5) lands
    on fp32's subnormal 2^-127. Multiplying by 2^126 is exact (denormals are not flushed
    here), so the second product is the reference's e2m1 * per_block."""
    bits = ((byte << (22 - SHIFT)) & 0x01C00000) | ((byte << (28 - SHIFT)) & -0x80000000)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37 * per_block  # 2^126


@triton.jit
def _dequantize_kernel(
    packed_ptr,  # [n_blocks * 8] uint8
    scales_ptr,  # [n_blocks] uint8 (e4m3 bytes)
    s2_ptr,  # 0-d fp32
    out_ptr,  # [n_blocks * 16] in the output dtype
    n_blocks,
    BLOCKS: tl.constexpr,
):
    blocks = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < n_blocks
    byte_cols = tl.arange(0, 8)
    packed = tl.load(
        packed_ptr + blocks[:, None] * 8 + byte_cols[None, :], mask=in_range[:, None], other=0
    ).to(tl.int32)
    scale = tl.load(scales_ptr + blocks, mask=in_range, other=0)
    # As reference.dequantize: per_block = fp32(s_b) * s2 rounded once, then one product
    # per element, then one cast to the output dtype.
    per_block = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(s2_ptr)
    lo = _decode_e2m1_scaled(packed, 0, per_block[:, None])
    hi = _decode_e2m1_scaled(packed, 4, per_block[:, None])
    values = tl.reshape(tl.join(lo, hi), (BLOCKS, 16))
    cols = tl.arange(0, 16)
    out = values.to(out_ptr.dtype.element_ty)  # round to nearest even on the GPU
    tl.store(out_ptr + blocks[:, None] * 16 + cols[None, :], out, mask=in_range[:, None])


def quantize(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], scales e4m3 [..., K/16]) for a given s2."""
    return _quantize(x, s2, _BLOCKS_PER_PROGRAM, num_warps=4)


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed, scales, s2) -> [..., K] in `dtype`, computed in fp32 and cast once."""
    return _dequantize(packed, scales, s2, dtype, _BLOCKS_PER_PROGRAM, num_warps=4)


def _quantize(x, s2, blocks: int, num_warps: int):
    k = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], k // BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    n_blocks = x.numel() // BLOCK
    if n_blocks:
        _quantize_kernel[(triton.cdiv(n_blocks, blocks),)](
            x.contiguous(),  # any strides in; the kernel reads one flat run of blocks
            packed.view(torch.int32),
            scales.view(torch.uint8),
            s2.to(device=x.device, dtype=torch.float32),
            n_blocks,
            BLOCKS=blocks,
            E2M1_MAX=E2M1_MAX,
            E4M3_MIN=E4M3_MIN,
            E4M3_MAX=E4M3_MAX,
            num_warps=num_warps,
        )
    return packed, scales


def _dequantize(packed, scales, s2, dtype, blocks: int, num_warps: int):
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype, device=packed.device)
    n_blocks = scales.numel()
    if n_blocks:
        _dequantize_kernel[(triton.cdiv(n_blocks, blocks),)](
            packed,
            scales.view(torch.uint8),
            s2.to(device=packed.device, dtype=torch.float32),
            out,
            n_blocks,
            BLOCKS=blocks,
            num_warps=num_warps,
        )
    return out
