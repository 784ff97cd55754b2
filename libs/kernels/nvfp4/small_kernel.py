"""NVFP4 weight-only linear for small layers in Gluon: decode once into
shared memory, then `mma.sync` from there.

SmolLM2's layers (576-wide) are latency-bound: torch runs 576 x 576 at 256 tokens in
~3.8 us, about three times an empty launch. linear_kernels' Triton kernel is one chain per
program of K steps, each a decode in registers and a wgmma it must wait for. Here a
program (4 warps) takes 64 weight rows and BM tokens over the whole K:

- every load of the program (the weight words and block scales of all K, and its x tile)
  is issued at once, so the program pays one memory latency;
- the 64 x K weights are decoded once (linear_kernels' word decode, 17 instructions per 8
  weights) into shared memory, in a K order permuted inside each 4-byte word
  ([lo b0, lo b1, lo b2, lo b3, hi b0, .., hi b3], the order the decode produces), and x
  is stored in the same order, so the dot products are unchanged;
- each warp then runs `mma.sync` (m16n8k16) for its 16 rows over all BM tokens from
  shared memory (ldmatrix), with nothing to wait for between steps.

BM is the smallest of 16, 32, 64 that keeps the programs to one wave (a program holds
9 * (8 + BM / 8) KB of shared memory at K = 576). Measured on an H200
(docs/notes/nvfp4-triton.md, session `small-pipelines`), against the Triton kernel's best
configs: 576 x 576 at M = 256 4.65 against 5.55 us (torch 3.78), at M = 64 3.97 against
4.94 (torch 3.68), at M = 1 3.79 against 4.86 (torch 3.56); 1536 x 576 at M = 256 6.08
against 6.68 (torch 4.21). K = 1536 (SmolLM2's down projection) measured slower here with
K split across programs (9.1 against 7.8 us at M = 256) and stays there; whole, its loads
would not fit in registers.

Numerics equal linear_kernels' (the same exact decoded weights, fp32 accumulation, s2 and
the power of two in the epilogue).
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .gemv_kernel import (
    _SCALE_ASM_BF16,
    _SCALE_ASM_F16,
    _WORD_ASM_BF16,
    _WORD_ASM_F16,
    _halves,
    _store,
)
from .linear_kernels import _DECODE

BN = 64  # weight rows per program: 16 per warp
MAX_K = 576  # SmolLM2's K (measured); more K holds more x in registers (spills at 768)


@functools.cache
def layouts(bm: int, num_warps: int):
    """(words [64, 8] per K chunk of 64, x chunk [BM, 64], accumulator [64, BM]) register
    layouts, and the shared layout of a decoded weight chunk or x chunk."""
    wl = gl.BlockedLayout([1, 2], [8, 4], [num_warps, 1], [1, 0])
    xl = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                    instr_shape=[16, 8])
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return wl, xl, mma, sw


@gluon.jit
def _decode_chunk(wd, sb, dtype: gl.constexpr):
    """Words [64, 8] (int32) and each word's e4m3 block scale byte [64, 8] -> the [64, 64]
    weights times their scale (pre-multiplied, as linear_kernels), in the permuted order."""
    if dtype == gl.bfloat16:
        word_asm: gl.constexpr = _WORD_ASM_BF16
        scale_asm: gl.constexpr = _SCALE_ASM_BF16
    else:
        word_asm: gl.constexpr = _WORD_ASM_F16
        scale_asm: gl.constexpr = _SCALE_ASM_F16
    # the scale byte with a zero high byte: the conversion's low half is the scale
    pairs = gl.inline_asm_elementwise(scale_asm, "=r,h", [sb.to(gl.int16)], dtype=gl.int32,
                                      is_pure=True, pack=1)
    scale, _ = gl.split(_halves(pairs, dtype))
    scale = gl.convert_layout(scale, wd.type.layout)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        word_asm, "=r,=r,=r,=r,r,h", [wd, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    w = gl.join(gl.join(_halves(p0, dtype), _halves(p1, dtype)),
                gl.join(_halves(p2, dtype), _halves(p3, dtype)))  # [64, word, e, p, n]
    w = gl.permute(w, (0, 1, 4, 3, 2))  # [64, word, nibble, byte]
    return gl.reshape(w, [wd.shape[0], 64])


@gluon.jit
def _permute_x(xt):
    """x chunk [BM, 64] in K order -> the decode's order inside each word (K = 2 byte +
    nibble goes to position 4 nibble + byte)."""
    x = gl.reshape(xt, [xt.shape[0], 8, 4, 2])  # [token, word, byte, nibble]
    return gl.reshape(gl.permute(x, (0, 1, 3, 2)), [xt.shape[0], 64])


@gluon.jit
def _small_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_w, stride_s, stride_om,  # w in int32 words, s in bytes
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
    OUT_LOG2: gl.constexpr,
    WL: gl.constexpr, XL: gl.constexpr, MMA: gl.constexpr, SW: gl.constexpr,
):
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    # Rows past N re-read row N - 1 and tokens past M token M - 1 (neither is stored), so
    # the loads need no masks.
    rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL)), N - 1)
    word = gl.arange(0, 8, layout=gl.SliceLayout(0, WL))
    w_ptrs = w_ptr + rows[:, None].to(gl.int64) * stride_w + word[None, :]
    s_ptrs = s_ptr + rows[:, None].to(gl.int64) * stride_s + (word // 2)[None, :]
    toks = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, XL)), M - 1)
    x_ptrs = (x_ptr + toks[:, None].to(gl.int64) * stride_xm
              + gl.arange(0, 64, layout=gl.SliceLayout(0, XL))[None, :])
    words = ()
    scales = ()
    xs = ()
    for c in gl.static_range(KC):  # every load in flight before the first is used
        words = words + (gl.load(w_ptrs + c * 8),)
        scales = scales + (gl.load(s_ptrs + c * 4),)
        xs = xs + (gl.load(x_ptrs + c * 64),)
    if BM <= 32:
        # A barrier here keeps the compiler from sinking each load down to its use, and
        # one shared allocation per chunk keeps it from putting a barrier between the
        # chunks' stores (it cannot tell index(c) from index(c + 1) of one allocation
        # apart): 576 x 576 at M = 256 4.65 against 4.85 us. At 64 tokens, where x alone
        # takes 144 registers a thread, pinning every load measured slower (1536 x 576 at
        # M = 256: 6.5 against 6.2 us), so there the stores go chunk by chunk.
        gl.thread_barrier()
        w_bufs = ()
        x_bufs = ()
        for c in gl.static_range(KC):
            w_bufs = w_bufs + (gl.allocate_shared_memory(
                dtype, [BN, 64], SW, _decode_chunk(words[c], scales[c], dtype)),)
            x_bufs = x_bufs + (gl.allocate_shared_memory(dtype, [BM, 64], SW,
                                                         _permute_x(xs[c])),)
    else:
        w_smem = gl.allocate_shared_memory(dtype, [KC, BN, 64], SW)
        x_smem = gl.allocate_shared_memory(dtype, [KC, BM, 64], SW)
        w_bufs = ()
        x_bufs = ()
        for c in gl.static_range(KC):
            w_smem.index(c).store(_decode_chunk(words[c], scales[c], dtype))
            x_smem.index(c).store(_permute_x(xs[c]))
            w_bufs = w_bufs + (w_smem.index(c),)
            x_bufs = x_bufs + (x_smem.index(c),)
    gl.thread_barrier()
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    for c in gl.static_range(KC):
        a = w_bufs[c].load(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
        b = x_bufs[c].permute((1, 0)).load(
            gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
        acc = mma_v2(a, b, acc)
    out_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    out_toks = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, MMA))
    _store(acc, out_rows, out_toks, s2_ptr, bias_ptr, out_ptr, N, M, stride_om, HAS_BIAS,
           OUT_LOG2)


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether this kernel handles the call: K in whole 64-wide chunks, at most MAX_K."""
    return k % 64 == 0 and 0 < k <= MAX_K


def viewable(packed: torch.Tensor) -> bool:
    """Whether packed can be read as int32 words (launch views it so)."""
    return packed.data_ptr() % 4 == 0


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where linear_kernels' Triton
    kernel runs instead: layers of 2^22 weights or more, K past MAX_K or not a multiple of
    64, and token counts that would take more than one wave at BM = 64. At up to 16 tokens
    (one 16-token tile) it measured faster than the Triton kernel's split K: 576 x 576 at
    M = 1 / 16 3.79 / 3.94 us against 4.86 / 4.90 (torch 3.56 / 3.65); 1536 x 576 at M = 1
    3.86 against 4.96 (torch 3.88). BM is the smallest
    of 16, 32, 64 whose programs fit in one wave: from a sweep on an H200 (session
    `small-pipelines`), 576 x 576 at M = 256 4.85 us with 32 (72 programs) against 5.76
    with 16 (144) and 5.88 with 64; 1536 x 576 at M = 256 6.08 with 64 (96 programs)
    against 7.41 with 32 (192)."""
    if n * k >= 2**22 or not fits(m, k, {}):
        return None
    for bm in (16, 32, 64):
        if triton.cdiv(n, BN) * triton.cdiv(m, bm) <= sms:
            return dict(BM=bm, num_warps=4)
    return None


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BM, num_warps); requires
    fits(M, K, cfg) and unit strides along K."""
    m, k = x2.shape
    n = packed.shape[0]
    assert fits(m, k, cfg), (m, k, cfg)
    wl, xl, mma, sw = layouts(cfg["BM"], cfg["num_warps"])
    words = packed.view(torch.int32)
    _small_kernel[(triton.cdiv(n, BN), triton.cdiv(m, cfg["BM"]))](
        x2, words, scales.view(torch.uint8), s2, bias if bias is not None else out, out,
        m, n, x2.stride(0), words.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BN=BN, BM=cfg["BM"], KC=k // 64,
        OUT_LOG2=_DECODE[x2.dtype][1],
        WL=wl, XL=xl, MMA=mma, SW=sw, num_warps=cfg["num_warps"])
    return out
