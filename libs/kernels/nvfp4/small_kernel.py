"""NVFP4 weight-only linear for small layers in Gluon: decode once into shared memory,
then wgmma from there.

SmolLM2's layers (576-wide) are latency-bound: torch runs 576 x 576 at 256 tokens in
~3.8 us, about three times an empty launch. linear_kernels' Triton kernel is one chain per
program of K steps, each a decode in registers and a wgmma it must wait for. Here a
program (one warpgroup, or two splitting the tokens) takes 64 weight rows and BM tokens
over the whole K:

- every load of the program (the weight words and block scales of all K, its x tile, s2
  and the bias) is issued at once, so the program pays one memory latency;
- the 64 x K weights are decoded once (linear_kernels' word decode, 17 instructions per 8
  weights) into shared memory;
- one barrier, then every wgmma of the program is issued back to back from shared memory,
  and waited for once.

x reaches shared memory one of two ways (X_TMA):
- tiles of 8 or 16 tokens load it into registers and store it permuted inside each 8-wide
  group the way the decode leaves the weights ([lo b0, lo b1, lo b2, lo b3, hi b0, ..,
  hi b3]), so the dot products are unchanged;
- tiles of 32 or 64 tokens take it by TMA in K order, and the weights are decoded in K
  order instead (_NATURAL_ASM): 576 x 576 at M = 256 in 4.07 us against 4.25, where
  x's 36 KB a program through registers took about as long to arrive as the whole
  decode; 3.98 against 4.11 since the decode pairs the nibbles in K order itself
  instead of re-pairing them (session `floors`).

BM is the smallest of 8 (up to 64 tokens), 16, 32, 64 that keeps the programs to one
wave (a program holds 9 * (8 + BM / 8) KB of shared memory at K = 576). Measured on an H200
(docs/notes/nvfp4-triton.md, sessions `small-wgmma` and `small-tma-x`), against torch in
three interleaved rounds: 576 x 576 at M = 256 4.07 us (torch 3.75), at M = 64 3.69
(3.65), at M = 1 3.54 (3.57); 1536 x 576 at M = 256 4.77 (4.24). K = 1536 (SmolLM2's down
projection) measured slower here, in phases of K through a ring of shared buffers
(7.5-8.9 against the Triton kernel's 4.65-7.85 us), and goes to gemm_kernel or the
Triton kernel.

Numerics equal linear_kernels' (the same exact decoded weights, fp32 accumulation, s2 and
the power of two in the epilogue).
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gemm_kernel import tma_ready as _tma_ready  # x by TMA where x allows it
from .gemv_kernel import (
    _SCALE_ASM_BF16,
    _SCALE_ASM_F16,
    _WORD_ASM_BF16,
    _WORD_ASM_F16,
    _halves,
    _load_s2_bias,
    _store_scaled,
)
from .linear_kernels import _DECODE, DECODE_BITS_BF16, DECODE_BITS_F16

# PTX: the word decode (_WORD_ASM_*) with other byte selectors, for x that comes by TMA in
# K order: prmt takes the word shifted left by 4 (w4) and the word itself as its two
# sources, so each output register pairs byte j's low nibble (from w4) with its high
# nibble (from the word). The pairs come out (lo b0, hi b0), (lo b1, hi b1), .. in K
# order at the same 17 instructions per 8 weights (gemm_fragment's byte decode, on a whole
# word), where re-pairing the word decode's (lo b0, lo b1), .. cost 4 more prmt a word.
# The same bits per nibble, so the same values.
_NATURAL_ASM = """
{{
.reg .b32 w4, p, s;
mov.b32 s, {{$5, $5}};
shl.b32 w4, $4, 4;
prmt.b32 p, w4, $4, 0xC480;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $0, p, s;
prmt.b32 p, w4, $4, 0xD591;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $1, p, s;
prmt.b32 p, w4, $4, 0xE6A2;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $2, p, s;
prmt.b32 p, w4, $4, 0xF7B3;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $3, p, s;
}}
"""
_NATURAL_ASM_BF16 = gl.constexpr(_NATURAL_ASM.format(**DECODE_BITS_BF16))
_NATURAL_ASM_F16 = gl.constexpr(_NATURAL_ASM.format(**DECODE_BITS_F16))

BN = 64  # weight rows per program: one wgmma's M
MAX_K = 576  # SmolLM2's K (measured); more K holds more x in registers (spills at 768)


@functools.cache
def layouts(bm: int, num_warps: int):
    """(words [64, 8] per K chunk of 64, x chunk [BM, 64], accumulator [64, BM]) register
    layouts, and the shared layout of a decoded weight chunk or x chunk. num_warps is 4
    (one warpgroup) or 8 (the two warpgroups take half the tokens each)."""
    wl = gl.BlockedLayout([1, 2], [8, 4], [num_warps, 1], [1, 0])
    # x: 8 a thread where the tile has that many, else fewer, so no thread holds a copy
    per = max(2, min(8, bm * 64 // (32 * num_warps)))
    xl = gl.BlockedLayout([1, per], [per // 2, 64 // per], [num_warps, 1], [1, 0])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                    instr_shape=[16, bm * 4 // num_warps, 16])
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return wl, xl, acc, sw


@gluon.jit
def _decode_chunk(wd, sb, dtype: gl.constexpr, NATURAL: gl.constexpr):
    """Words [64, 8] (int32) and each word's e4m3 block scale byte [64, 8] -> the [64, 64]
    weights times their scale (pre-multiplied, as linear_kernels), in K order (NATURAL,
    for x brought by TMA: _NATURAL_ASM) or in the word decode's order (x permuted to match
    on its way through registers, which measured faster there than x and weights in K
    order: 576 x 576 at M = 1 3.40 against 3.55 us, at M = 128 3.76 against 3.96)."""
    if dtype == gl.bfloat16:
        word_asm: gl.constexpr = _NATURAL_ASM_BF16 if NATURAL else _WORD_ASM_BF16
        scale_asm: gl.constexpr = _SCALE_ASM_BF16
    else:
        word_asm: gl.constexpr = _NATURAL_ASM_F16 if NATURAL else _WORD_ASM_F16
        scale_asm: gl.constexpr = _SCALE_ASM_F16
    # the scale byte with a zero high byte: the conversion's low half is the scale
    pairs = gl.inline_asm_elementwise(scale_asm, "=r,h", [sb.to(gl.int16)], dtype=gl.int32,
                                      is_pure=True, pack=1)
    scale, _ = gl.split(_halves(pairs, dtype))
    scale = gl.convert_layout(scale, wd.type.layout)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        word_asm, "=r,=r,=r,=r,r,h", [wd, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    # [64, word, h, i, o]: register 2o + i, its half h. NATURAL: register j holds byte j's
    # low (h = 0) and high nibble, K = 8 word + 2j + h. Else the word decode's nibble o of
    # byte 2i + h, K = 8 word + 2(2i + h) + o, the order _permute_x gives x.
    w = gl.join(gl.join(_halves(p0, dtype), _halves(p1, dtype)),
                gl.join(_halves(p2, dtype), _halves(p3, dtype)))
    w = gl.permute(w, (0, 1, 4, 3, 2))  # [64, word, o, i, h]
    return gl.reshape(w, [wd.shape[0], 64])


@gluon.jit
def _permute_x(xt):
    """x chunk [BM, 64] in K order -> the decode's order inside each word (K = 2 byte +
    nibble goes to position 4 nibble + byte)."""
    x = gl.reshape(xt, [xt.shape[0], 8, 4, 2])  # [token, word, byte, nibble]
    return gl.reshape(gl.permute(x, (0, 1, 3, 2)), [xt.shape[0], 64])


@gluon.jit
def _x_by_tma(x_desc, row, KC: gl.constexpr, SW: gl.constexpr):
    """Start TMA copies of the x tile [BM, 64 KC] (rows past M arrive as zeros) into one
    shared buffer per chunk; returns (the buffers, the barrier that says they arrived)."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [KC] + x_desc.block_type.shape, SW)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), KC * x_desc.block_type.nbytes)
    for c in gl.static_range(KC):
        tma.async_copy_global_to_shared(x_desc, [row, c * 64], bar.index(0), x_smem.index(c))
    return x_smem, bar


@gluon.jit
def _small_kernel(
    x_ptr, x_desc, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_w, stride_s, stride_om,  # w in int32 words, s in bytes
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
    OUT_LOG2: gl.constexpr, X_TMA: gl.constexpr,
    WL: gl.constexpr, XL: gl.constexpr, ACC: gl.constexpr, SW: gl.constexpr,
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
    # The epilogue's global operands too: loaded there, they cost one more memory latency
    # after the last wgmma (576 x 576 at M = 64: 3.69 against 3.77 us).
    out_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
    s2, bias = _load_s2_bias(s2_ptr, bias_ptr, out_rows, N, HAS_BIAS)
    words = ()
    scales = ()
    xs = ()
    for c in gl.static_range(KC):  # every load in flight before the first is used
        words = words + (gl.load(w_ptrs + c * 8),)
        scales = scales + (gl.load(s_ptrs + c * 4),)
        if not X_TMA:
            xs = xs + (gl.load(x_ptrs + c * 64),)
    if X_TMA:  # issued after the weights' loads, which the decode waits for first
        x_smem, x_bar = _x_by_tma(x_desc, pid_m * BM, KC, SW)
    # This barrier keeps the compiler from sinking each load down to its use, and one
    # shared allocation per chunk keeps it from putting a barrier between the chunks'
    # stores (it cannot tell index(c) from index(c + 1) of one allocation apart): 576 x 576
    # at M = 256 4.65 against 4.85 us (session `small-pipelines`, with mma.sync).
    gl.thread_barrier()
    w_bufs = ()
    x_bufs = ()
    for c in gl.static_range(KC):
        w_bufs = w_bufs + (gl.allocate_shared_memory(
            dtype, [BN, 64], SW, _decode_chunk(words[c], scales[c], dtype, X_TMA)),)
        if X_TMA:
            x_bufs = x_bufs + (x_smem.index(c),)
        else:
            x_bufs = x_bufs + (gl.allocate_shared_memory(dtype, [BM, 64], SW,
                                                         _permute_x(xs[c])),)
    fence_async_shared()  # the generic stores above before wgmma's async reads
    gl.thread_barrier()
    if X_TMA:
        mbarrier.wait(x_bar.index(0), 0)
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for c in gl.static_range(KC):
        acc = warpgroup_mma(w_bufs[c], x_bufs[c].permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if X_TMA:
        mbarrier.invalidate(x_bar.index(0))
    out_toks = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))
    _store_scaled(acc, out_rows, out_toks, s2, bias, out_ptr, N, M, stride_om, HAS_BIAS,
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
    64, and token counts that would take more than one wave at BM = 64.

    From sweeps on an H200 (sessions `small-pipelines`, `small-wgmma`, `small-tma-x`):
    - BM is the smallest of 16, 32, 64 whose programs fit in one wave: 576 x 576 at
      M = 256 4.22 us with 32 (72 programs) against 5.11 with 64; 1536 x 576 at M = 256
      6.08 with 64 (96 programs) against 7.41 with 32 (192, mma.sync form);
    - up to 64 tokens, tiles of 8 (wgmma N = 8) where they fit in one wave: each program
      then multiplies less x, and there are more of them (session `floors`, three
      interleaved rounds): 576 x 576 at M = 1 / 16 / 64 3.42 / 3.58 / 3.64 us against
      3.57 / 3.86 / 3.72 with 16 (torch 3.61 / 3.67 / 3.68); 1536 x 576 at M = 1 3.48
      against 3.63 (torch 3.88). Past 64 tokens they lost (192 x 576 at M = 256, 96
      programs: 3.84 against 3.71), as past one wave (576 x 576 at M = 128: 5.09 against
      3.79);
    - tiles of 32 or 64 tokens take x by TMA (X_TMA): 576 x 576 at M = 256 4.07 against
      4.25 us for x through registers, 1536 x 576 at M = 256 4.97 against 5.32 (torch 3.75
      / 4.18). Tiles of 16 keep x through registers: there x by TMA measured 0.1-0.2 us
      slower (576 x 576 at M = 64: 3.81 against 3.69);
    - 32-token tiles run on two warpgroups, which split the tokens and the decode (576 x
      576 at M = 256: 4.12 against 4.21 us on one); 64-token tiles on one (1536 x 576 at
      M = 256: 4.77 against 4.96 us on two), where the two warpgroups' wgmmas would each
      read all the decoded weights from shared memory again;
    - at up to 16 tokens it beats the Triton kernel's split K: 576 x 576 at M = 1 / 16
      3.59 / 3.86 us, where the Triton kernel took 4.86 / 4.90 (torch 3.58 / 3.66)."""
    if n * k >= 2**22 or not fits(m, k, {}):
        return None
    for bm in (8, 16, 32, 64) if m <= 64 else (16, 32, 64):
        if triton.cdiv(n, BN) * triton.cdiv(m, bm) <= sms:
            return dict(BM=bm, num_warps=8 if bm == 32 else 4, X_TMA=bm > 16)
    return None


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BM, num_warps, X_TMA); requires
    fits(M, K, cfg) and unit strides along K. An x that TMA cannot read (a misaligned
    view) goes through registers instead."""
    m, k = x2.shape
    n = packed.shape[0]
    assert fits(m, k, cfg), (m, k, cfg)
    bm = cfg["BM"]
    # a warpgroup's wgmma takes at least 8 tokens: 8-token tiles run on one warpgroup
    assert bm in (16, 32, 64) or (bm == 8 and cfg["num_warps"] == 4), cfg
    wl, xl, acc, sw = layouts(bm, cfg["num_warps"])
    x_tma = cfg.get("X_TMA", False) and _tma_ready(x2)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, 64], sw) if x_tma else x2
    words = packed.view(torch.int32)
    _small_kernel[(triton.cdiv(n, BN), triton.cdiv(m, bm))](
        x2, x_desc, words, scales.view(torch.uint8), s2, bias if bias is not None else out,
        out, m, n, x2.stride(0), words.stride(0), scales.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BN=BN, BM=bm, KC=k // 64,
        OUT_LOG2=_DECODE[x2.dtype][1], X_TMA=x_tma,
        WL=wl, XL=xl, ACC=acc, SW=sw, num_warps=cfg["num_warps"])
    return out
