"""NVFP4 weight-only linear for small layers in Gluon: decode once into shared memory,
then wgmma from there.

SmolLM2's layers (576-wide) are latency-bound: torch runs 576 x 576 at 256 tokens in
~3.8 us, about three times an empty launch. linear_kernels' Triton kernel is one chain per
program of K steps, each a decode in registers and a wgmma it must wait for. Here a
program takes 64 tokens (128 on two warpgroups) and 16 or 32 weight rows over the whole
K:

- every load of the program (the weight words and block scales of all K, s2 and the
  bias, and its x tile by TMA) is issued at once, so it pays one memory latency;
- its weights are decoded once (linear_kernels' decode, 17 instructions per 8 weights,
  the pairs in K order: gemv_kernel.NATURAL_PRMTS) into shared memory;
- one barrier, then every wgmma is issued back to back, x as the A operand (the tokens
  are the MMA's M) and the decoded weights as B, and waited for once;
- the epilogue stores 16 bytes a thread, whole 32-byte sectors (_store_tokens' WIDE: at
  M = 256 the accumulator's 4-byte stores were 0.77 of gate/up's 4.70 us).

x as the A operand is what makes the rows per program few: wgmma's M is 64, its N can be
16. Until session `floors` the weights were A, so a program decoded 64 rows and took 8-64
tokens as N; with 16-32 rows a program decodes a quarter to a half of that: 576 x 576 at
M = 256 in 3.48 us against 3.98 (torch 3.77), 192 x 576 in 2.94 against 3.70 (3.62),
576 x 576 at M = 1 3.10 against 3.43 (3.59), three interleaved rounds on an H200
(docs/notes/nvfp4-triton.md, sessions `small-pipelines`, `small-wgmma`, `small-tma-x`,
`floors`). An x that TMA cannot read (a misaligned view) goes to linear_kernels' Triton
kernel past 32 tokens (`readable`).

Up to 32 tokens (X_REGS) x skips shared memory: each thread loads its A fragment straight
from global memory, two 16-byte loads per token row and chunk, and the wgmmas read only
the weights from shared memory. The fragment pairs K as (2q, 2q + 1, 2q + 8, 2q + 9) per
16-wide step, q = lane % 4; K is reordered inside each 64-wide chunk, identically for x
and the decoded weights (a sum does not care about the order of its terms), so that a
thread's fragment over the chunk's four steps is memory K 16q .. 16q + 15 (see
_x_to_registers). The TMA form fills a 64-token tile (74 KB) for one token and the MMA
reads it all; this form loads only the rows below M. Three interleaved rounds (session
`x-registers`), us against the TMA form (torch): SmolLM2's 576 x 576 at M = 1 2.70 against
3.11 (3.59), 1536 x 576 2.85 against 3.47 (3.93), the engine's fused 960 x 576 2.73
against 3.44 (4.01) and 3072 x 576 3.28 against the Triton kernel's 5.38 (4.11). A TMA box
whose rows run past M also costs: at 17-32 tokens 1536 x 576 takes 3.68-3.79 with x by
TMA against 3.12 at 64, and 3.03-3.16 here; the engine's 960 x 576 2.95-3.06 against
3.23-3.36, 3072 x 576 3.54-3.82 against 3.92-4.07; 576 x 576 ties (2.89-3.02 against
2.97-2.99) and 192 x 576 loses 0.04-0.11 (2.82-2.93). From 40 tokens the TMA form wins
except on 1536 rows, and at 256 this form loses (1536 x 576 5.10 against 4.57: a
program's 128 token rows through the load path). Past one tile, where M is not whole
tiles, the last tile moves back to end at M, so no box runs past M (tile_row0, since
session `long-light`; small_phased_kernel does the same).

Longer K (SmolLM2's down projection, K = 1536) does not fit x's tile in shared memory:
small_phased_kernel streams it through a ring.

Numerics equal linear_kernels' (the same exact decoded weights, fp32 accumulation, s2 and
the power of two in the epilogue).
"""

import functools

import torch
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

from .gemm_kernel import tma_ready
from .gemv_kernel import (
    _SCALE_ASM_BF16,
    _SCALE_ASM_F16,
    L2_PREFETCH,
    NATURAL_ASM_BF16,
    NATURAL_ASM_F16,
    _halves,
    _load_s2_bias,
    words_load_asm,
)
from .grid import cdiv, shifts_last_tile
from .launch_cache import Launch, LaunchCache
from .linear_kernels import _DECODE

MAX_K = 576  # SmolLM2's K (measured); x's 64 x K tile a warpgroup fills shared memory
X_REGS_MAX_M = 32  # up to here x goes straight to registers (measured: see the module doc)


@functools.cache
def layouts(bn: int, num_warps: int):
    """(words [bn, 8] per K chunk of 64, accumulator [16 num_warps tokens, bn]) register
    layouts and the shared layout of an x or weight chunk. Each thread holds
    bn * 8 / (32 num_warps) words of a chunk (1, 2 or 4 at 16, 32, 64 rows on 4 warps); 8 warps
    are two warpgroups, each with its own 64 tokens."""
    per = bn * 8 // (32 * num_warps)
    wl = gl.BlockedLayout([1, per], [32 * per // 8, 8 // per], [num_warps, 1], [1, 0])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                    instr_shape=[16, bn, 16])
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return wl, acc, sw


@functools.cache  # one object per config: the launcher keys its compiled kernels on it
def x_layout(num_warps: int):
    """x's register layout for X_REGS, over [tokens / 16, 2, 8, 4, 16]: thread (warp w, lane
    t) holds token rows 16 w + 8 h + t / 4 (h = 0, 1) and memory K 16 q .. 16 q + 15 of each
    chunk, q = t % 4: the rows and the K columns of its wgmma A fragment."""
    return gl.BlockedLayout([1, 2, 1, 1, 16], [1, 1, 8, 4, 1], [num_warps, 1, 1, 1, 1],
                            [4, 3, 2, 1, 0])


@gluon.jit
def _register_k_order(t):
    """[R, 64] in memory K order -> the order X_REGS multiplies in: position 16 s + 8 h +
    2 q + e holds memory K 16 q + 4 s + 2 h + e (s: the 16-wide step, q: the fragment's
    column pair, h: its low or high half, e: the element of a pair)."""
    R: gl.constexpr = t.shape[0]
    t = gl.permute(gl.reshape(t, [R, 4, 4, 2, 2]), (0, 2, 3, 1, 4))
    return gl.reshape(t, [R, 64])


@gluon.jit
def _x_to_registers(x_ptr, stride_xm, row0, M, KC: gl.constexpr, BM: gl.constexpr,
                    XL: gl.constexpr, AL: gl.constexpr):
    """x [row0, row0 + BM) x all K as KC wgmma A fragments in _register_k_order (rows past M
    are zeros and not read): the loads are in memory order, and the reorder only renames
    registers (the compiler checks that: assert_trivial)."""
    l0: gl.constexpr = gl.SliceLayout(
        1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l1: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l2: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l3: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, XL))))
    l4: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    warp = gl.arange(0, BM // 16, layout=l0)[:, None, None, None, None]
    half = gl.arange(0, 2, layout=l1)[None, :, None, None, None]
    lane_row = gl.arange(0, 8, layout=l2)[None, None, :, None, None]
    q = gl.arange(0, 4, layout=l3)[None, None, None, :, None]
    e = gl.arange(0, 16, layout=l4)[None, None, None, None, :]
    rows = row0 + 16 * warp + 8 * half + lane_row
    ptrs = x_ptr + rows.to(gl.int64) * stride_xm + (16 * q + e)
    mask = (rows < M) & (e >= 0)  # e >= 0 only broadcasts the mask to the pointers' shape
    chunks = ()
    for c in gl.static_range(KC):  # every load in flight before the first is used
        chunks = chunks + (gl.load(ptrs + c * 64, mask=mask, other=0.0),)
    xa = ()
    for c in gl.static_range(KC):
        t = gl.reshape(chunks[c], [BM // 16, 2, 8, 4, 4, 2, 2])  # e = (s, h, pair element)
        t = gl.reshape(gl.permute(t, (0, 1, 2, 4, 5, 3, 6)), [BM, 64])
        xa = xa + (gl.convert_layout(t, AL, assert_trivial=True),)
    return xa


@gluon.jit
def _decode_chunk(wd, sb, dtype: gl.constexpr):
    """Words [R, W] (int32; W = 8 is a chunk of 64 K) and each word's e4m3 block scale
    byte [R, W] -> the [R, 8 W] weights times their scale (pre-multiplied, as
    linear_kernels), in K order."""
    if dtype == gl.bfloat16:
        word_asm: gl.constexpr = NATURAL_ASM_BF16
        scale_asm: gl.constexpr = _SCALE_ASM_BF16
    else:
        word_asm: gl.constexpr = NATURAL_ASM_F16
        scale_asm: gl.constexpr = _SCALE_ASM_F16
    # the scale byte with a zero high byte: the conversion's low half is the scale
    pairs = gl.inline_asm_elementwise(scale_asm, "=r,h", [sb.to(gl.int16)], dtype=gl.int32,
                                      is_pure=True, pack=1)
    scale, _ = gl.split(_halves(pairs, dtype))
    scale = gl.convert_layout(scale, wd.type.layout)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        word_asm, "=r,=r,=r,=r,r,h", [wd, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    # register j = 2o + i holds byte j's low (h = 0) and high nibble: K = 8 word + 2j + h
    w = gl.join(gl.join(_halves(p0, dtype), _halves(p1, dtype)),
                gl.join(_halves(p2, dtype), _halves(p3, dtype)))  # [BN, word, h, i, o]
    w = gl.permute(w, (0, 1, 4, 3, 2))  # [BN, word, o, i, h]
    return gl.reshape(w, [wd.shape[0], 8 * wd.shape[1]])


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


def words_prefetch(packed: torch.Tensor) -> int:
    """The word loads' L2 prefetch size in bytes (0: plain loads): L2_PREFETCH where every
    row's words start 16-byte aligned, so a thread's words go in one vector load."""
    aligned = packed.data_ptr() % 16 == 0 and packed.stride(0) % 16 == 0
    return L2_PREFETCH if aligned else 0


def words_asm(packed: torch.Tensor, wl: gl.BlockedLayout) -> str:
    """_load_rows' word loads as PTX (gemv_kernel.words_load_asm): a thread's words of a
    chunk (wl) in one load with words_prefetch's hint; "" (plain loads) without one."""
    return words_load_asm(words_prefetch(packed), wl.size_per_thread[1])


@gluon.constexpr_function
def _words_constraints(per):
    return ",".join(["=r"] * per + ["l"] * per)


@gluon.jit
def _load_rows(w_ptr, s_ptr, s2_ptr, bias_ptr, pid_n, N, stride_w, stride_s,
               HAS_BIAS: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
               WL: gl.constexpr, ACC: gl.constexpr, WORDS_ASM: gl.constexpr):
    """Issue every load of program pid_n's BN weight rows: s2 and the bias (in the
    accumulator's row layout), then the words and block scale bytes of all KC chunks (in
    WL, all in flight before the first is used: _load_words). Returns (words, scales,
    out_rows, s2, bias)."""
    w_ptrs, s_ptrs = _word_pointers(w_ptr, s_ptr, pid_n * BN, N, stride_w, stride_s, BN, 8, WL)
    out_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
    s2, bias = _load_s2_bias(s2_ptr, bias_ptr, out_rows, N, HAS_BIAS)
    words, scales = _load_words(w_ptrs, s_ptrs, 8, KC, WORDS_ASM)
    return words, scales, out_rows, s2, bias


@gluon.jit
def _word_pointers(w_ptr, s_ptr, row0, N, stride_w, stride_s, R: gl.constexpr,
                   W: gl.constexpr, WL: gl.constexpr):
    """Pointers [R, W] (in WL) to the first W words of weight rows [row0, row0 + R)
    (clamped to N - 1) and to each word's block scale byte."""
    rows = gl.minimum(row0 + gl.arange(0, R, layout=gl.SliceLayout(1, WL)), N - 1)
    word = gl.arange(0, W, layout=gl.SliceLayout(0, WL))
    w_ptrs = w_ptr + rows[:, None].to(gl.int64) * stride_w + word[None, :]
    s_ptrs = s_ptr + rows[:, None].to(gl.int64) * stride_s + (word // 2)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _load_words(w_ptrs, s_ptrs, W: gl.constexpr, NL: gl.constexpr, WORDS_ASM: gl.constexpr):
    """Issue NL loads of W words a row from _word_pointers' pointers (load i: words
    [W i, W i + W), so with W = 8 chunk i) and of their scale bytes, all in flight before
    the first is used. Returns (words, scales), tuples of NL tensors.

    WORDS_ASM (words_asm): the word loads ask L2 to fetch the 128 bytes around them, so a
    row's DRAM reads come in fewer, larger pieces. A program reads its rows' whole K, so
    nothing fetched goes unused. Bit-equal; five interleaved rounds on an H200
    (docs/notes/nvfp4-triton.md, session `register-a`), us, a 128-byte prefetch against plain loads
    (torch): 3072 x 576 at M = 128 / 256 4.27 / 5.51 against 4.33 / 5.67 (4.41 / 4.55),
    960 x 576 at M = 256 3.40 against 3.45 (3.90), 576 x 576 at M = 256 3.26 against 3.30
    (3.77), 1536 x 576 at M = 256 4.21 against 4.24 (4.23), 576 x 1536 (small_phased_kernel)
    at M = 64 / 256 4.92 / 5.68 against 4.96 / 5.70 (5.06 / 5.21); at 1-16 tokens within
    0.02. 256 bytes measured the same as 128."""
    PER: gl.constexpr = w_ptrs.type.layout.size_per_thread[1]
    words = ()
    scales = ()
    for c in gl.static_range(NL):
        if WORDS_ASM == "":
            words = words + (gl.load(w_ptrs + c * W),)
        else:  # volatile, so the loads stay ahead of everything after them
            words = words + (gl.inline_asm_elementwise(
                WORDS_ASM, _words_constraints(PER), [w_ptrs + c * W], dtype=gl.int32,
                is_pure=False, pack=PER),)
        scales = scales + (gl.load(s_ptrs + c * (W // 2)),)
    return words, scales


@gluon.jit
def _decode_to_shared(words, scales, SW: gl.constexpr, dtype: gl.constexpr,
                      X_REGS: gl.constexpr):
    """Each chunk's decoded [BN, 64] weights in its own shared buffer (wgmma's B), in K
    order or, for X_REGS, in _register_k_order; fenced for the async reads. The first
    barrier pins the loads issued before it ahead of the decode."""
    gl.thread_barrier()
    w_bufs = ()
    for c in gl.static_range(len(words)):
        w = _decode_chunk(words[c], scales[c], dtype)
        if X_REGS:
            w = _register_k_order(w)
        w_bufs = w_bufs + (gl.allocate_shared_memory(dtype, [words[c].shape[0], 64], SW, w),)
    fence_async_shared()  # the generic stores above before wgmma's async reads
    gl.thread_barrier()
    return w_bufs


@gluon.jit
def _store_tokens(acc, row0, first, out_rows, s2, bias, out_ptr, M, N, stride_om,
                  HAS_BIAS: gl.constexpr, OUT_LOG2: gl.constexpr, WIDE: gl.constexpr,
                  ROWS_MADE: gl.constexpr = False):
    """out[tokens, rows] = acc * 2^OUT_LOG2 * s2 (+ bias) for the tile's tokens (row0 on)
    and weight rows out_rows (in the accumulator's column layout; with ROWS_MADE, the
    first of them, a scalar), masked to [first, M) and to N: each token's rows are
    contiguous. first > row0 where the tile was moved back to end at M (tile_row0): its
    rows before first belong to the tile before it.

    In the accumulator's layout a thread holds two adjacent rows of a token: 4-byte
    stores, a warp's store half of a 32-byte sector per token. WIDE moves the scaled tile
    (through shared memory) to a layout where a thread holds eight, so its 16-byte stores
    fill their sectors. Bit-equal either way; five interleaved rounds on an H200
    (docs/notes/nvfp4-triton.md, session `intake`), us, WIDE against not (torch): 1536 x 576
    at M = 256 4.24 against 4.63 (4.22), 960 x 576 3.48 against 3.79 (3.93), 3072 x 576
    at M = 128 4.42 against 4.77 (4.40); ties at 64 tokens; at 1-16 tokens (X_REGS) it
    loses 0.05-0.11 us (the move's barrier on a kernel of ~3 us), so those keep the
    accumulator's layout, and so do outputs the 16-byte stores do not fit (wide_stores
    decides on the host).

    The row indices go with the tile through shared memory too, or with ROWS_MADE are
    made in the store's layout from the first. Bit-equal; two runs of five
    interleaved rounds on an H100 (docs/notes/nvfp4-triton.md, session `epilogue`): made
    anew, small_kernel lost 0.1-0.25 us at 576 x 576 (M = 256) and 1536 x 576 (M = 128)
    and won 0.15-0.20 at 3072 x 576, while small_phased_kernel won (it passes ROWS_MADE)."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    y = (acc * (2.0**OUT_LOG2)) * s2  # the power of two is exact
    if HAS_BIAS:
        y += bias[None, :]
    y = y.to(out_ptr.dtype.element_ty)
    if WIDE:
        SL: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BN, BN // 8],
                                            [gl.num_warps(), 1], [1, 0])
        y = gl.convert_layout(y, SL)
        if not ROWS_MADE:
            out_rows = gl.convert_layout(out_rows, gl.SliceLayout(0, SL))
    if ROWS_MADE:
        out_rows = out_rows + gl.arange(0, BN, layout=gl.SliceLayout(0, y.type.layout))
    toks = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, y.type.layout))
    ptrs = out_ptr + toks[:, None].to(gl.int64) * stride_om + out_rows[None, :]
    gl.store(ptrs, y, mask=((toks >= first) & (toks < M))[:, None] & (out_rows < N)[None, :])


@gluon.jit
def tile_row0(pid_m, M, BM: gl.constexpr, SHIFT: gl.constexpr):
    """The first token of program pid_m's tile: pid_m * BM, except where x comes by TMA
    and the launch moves the last tile back (SHIFT: shifts_last_tile, so M > BM); then
    the last tile ends at M, so its boxes never run past M. Its rows before pid_m * BM
    repeat the tile before it and are not stored (_store_tokens' first); a row of the
    product depends on its own row of x alone, so the outputs are bit-equal. Boxes past
    M (the TMA unit fills those rows with zeros) cost a program up to several us on long
    K: A/B on one H200, five interleaved
    rounds (docs/notes/nvfp4-triton.md, session `long-light`), us, moved against not
    (torch): 1024 x 2048 (phased) at M = 65 / 100 6.10 / 6.15 against 10.62 / 8.14 (6.06 /
    6.04), 960 x 2560 at M = 65 / 96 7.26 / 7.27 against 12.84 / 9.08 (6.65 / 6.69), 576 x
    1536 at M = 65 4.84 against 5.51 (5.14; at M = 100 4.86 against 4.81), small_kernel's
    1536 x 576 at M = 65 / 100 / 200 3.40 / 3.42 / 4.22 against 3.72 / 3.50 / 4.86 (3.88 /
    3.83 / 4.10), 576 x 576 at M = 65 3.09 against 3.37 (3.71)."""
    row0 = pid_m * BM
    if SHIFT:
        # M > BM, so the clamp at 0 never binds: it compiles into the min (min.relu) and
        # tells the compiler row0 is not negative
        row0 = gl.maximum(gl.minimum(row0, M - BM), 0)
    return row0


@gluon.jit
def _small_kernel(
    x_src, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_w, stride_s, stride_om,  # w in int32 words, s in bytes
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
    OUT_LOG2: gl.constexpr, WL: gl.constexpr, ACC: gl.constexpr, SW: gl.constexpr,
    X_REGS: gl.constexpr, XL: gl.constexpr, WIDE: gl.constexpr, WORDS_ASM: gl.constexpr,
    SHIFT: gl.constexpr,
):
    """out[tokens, rows] for BM tokens (64 a warpgroup: wgmma's A, from x_src, a TMA
    descriptor whose rows past M arrive as zeros, or for X_REGS x's pointer, loaded into
    registers) and BN weight rows (decoded into shared memory: wgmma's B) over the whole
    K; the store writes each token's rows contiguously."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    words, scales, out_rows, s2, bias = _load_rows(
        w_ptr, s_ptr, s2_ptr, bias_ptr, pid_n, N, stride_w, stride_s, HAS_BIAS, BN, KC, WL, ACC,
        WORDS_ASM)
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    row0 = tile_row0(pid_m, M, BM, SHIFT)  # SHIFT with x by TMA only (the host sets it so)
    if X_REGS:
        dtype: gl.constexpr = x_src.dtype.element_ty
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        xa = _x_to_registers(x_src, stride_xm, row0, M, KC, BM, XL, AL)
        w_bufs = _decode_to_shared(words, scales, SW, dtype, True)
        for c in gl.static_range(KC):
            acc = warpgroup_mma(xa[c], w_bufs[c].permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,) + xa)[0]
    else:
        x_smem, x_bar = _x_by_tma(x_src, row0, KC, SW)
        w_bufs = _decode_to_shared(words, scales, SW, x_src.dtype, False)
        mbarrier.wait(x_bar.index(0), 0)
        for c in gl.static_range(KC):
            acc = warpgroup_mma(x_smem.index(c), w_bufs[c].permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.invalidate(x_bar.index(0))
    _store_tokens(acc, row0, pid_m * BM, out_rows, s2, bias, out_ptr, M, N, stride_om, HAS_BIAS,
                  OUT_LOG2, WIDE)


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether this kernel handles the call: K in whole 64-wide chunks, at most MAX_K."""
    return k % 64 == 0 and 0 < k <= MAX_K


def readable(x2: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether this kernel can read x and packed as launch views them: packed as int32
    words, and x by TMA past X_REGS_MAX_M tokens (up to there plain loads read any x)."""
    return packed.data_ptr() % 4 == 0 and (x2.shape[0] <= X_REGS_MAX_M or tma_ready(x2))


def wide_stores(n: int, out: torch.Tensor) -> bool:
    """Whether the epilogue takes _store_tokens' 16-byte stores: where Triton's
    specialization tells the compiler that N and out's row stride are multiples of 16
    (otherwise the row mask may change within a thread's eight rows and the stores would
    split into 2-byte ones: not measured, so those keep the accumulator's layout)."""
    return n % 16 == 0 and out.stride(0) % 16 == 0 and out.data_ptr() % 16 == 0


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where linear_kernels' Triton
    kernel runs instead: layers of 2^22 weights or more, and K past MAX_K or not a multiple
    of 64.

    Up to X_REGS_MAX_M tokens: x through registers, 16 rows a program while at most two
    programs a SM (they fit: ~200 registers a thread on 4 warps), else 32. Three interleaved
    rounds (session `x-registers`), us, 16 rows against 32 (torch): 576 x 576 at M = 1 / 16
    / 32 2.70 / 2.91 / 3.02 against 3.00 / 3.30 / 3.45 (3.59 / 3.67 / 3.64), 1536 x 576 at
    M = 1 2.85 against 3.10 (3.93), 3072 x 576 (192 programs) at M = 1 / 32 3.28 / 3.82
    against 3.26 / 3.71 (4.11 / 4.16).

    Past that, x by TMA. From three interleaved rounds on SmolLM2's 576-wide layers at
    1-256 tokens (session `floors`; "before": the form with the weights as A): the fewest
    weight rows a program, 16 then 32, whose programs fit in one wave, on one warpgroup
    (64 tokens a program) before two (128, past 64 tokens):
    - 16 rows: 576 x 576 at M = 64 / 128 2.98 / 3.00 us against 3.62 / 3.78 (torch 3.67 /
      3.72); 192 x 576 at every M 2.78-2.94 against 3.34-3.70 (3.49-3.62); 1536 x 576 at
      M = 64 3.14 against 3.89 (3.82);
    - 32 rows where 16 take more than a wave: 576 x 576 at M = 256 3.48 against 3.99
      (3.77; 16 rows, 144 programs: 3.89); 1536 x 576 at M = 128 3.66 against 4.13 (3.95);
    - two warpgroups: 1536 x 576 at M = 256 4.69 against 4.79 (torch 4.20); 64 rows a
      program lost wherever 16 or 32 fit in a wave (4.5-5.8 us).

    Where neither does (wide layers such as the engine's fused gate_up, 3072 x 576, from
    129 tokens; long prompts), 64 rows a program, then 64 rows on two warpgroups in as
    many waves as it takes: faster than the Triton kernel these calls went to before
    (session `wide-slices`, three interleaved rounds, us, against the Triton kernel;
    torch): 3072 x 576 at M = 129 / 192 / 256 / 512 6.22 / 6.52 / 6.35 / 10.95 against
    6.87 / 8.55 / 8.71 / 15.45 (4.44 / 4.48 / 4.45 / 5.68); 4096 x 576 at M = 256 6.94
    against 14.10 (5.07); 2304 x 576 at M = 129 5.08 against 6.65 (4.20); 1536 x 576 at
    M = 512 6.30 against 8.67 (4.37); 576 x 576 at M = 1024 5.92 against 8.45 (4.19).
    Past two waves (prompts of 1024-8192 tokens; session `long-prompts`) 64 rows on two
    warpgroups stay ahead: 3072 x 576 at M = 1024 / 2048 / 4096 / 8192 16.38 / 30.29 /
    57.61 / 111.71 against 28.19 / 53.62 / 102.90 / 204.50 (torch 8.29 / 13.64 / 25.86 /
    49.46); 576, 960 and 1536 rows likewise, 1.33-1.97x faster
    (docs/notes/bench/long_m_sweep2.json). Still short of torch there."""
    if n * k >= 2**22 or not fits(m, k, {}):
        return None
    if m <= X_REGS_MAX_M:
        for bn in (16, 32):
            if cdiv(n, bn) <= 2 * sms:
                return dict(BN=bn, num_warps=4, X_REGS=True)
        return None
    for bn in (16, 32, 64):
        for w in (4, 8) if m > 64 else (4,):
            if bn * 8 >= 32 * w and cdiv(n, bn) * cdiv(m, 16 * w) <= sms:
                return dict(BN=bn, num_warps=w)
    return dict(BN=64, num_warps=8)


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BN, num_warps, X_REGS=False);
    requires fits(M, K, cfg), readable(x2, packed) (with X_REGS: only packed's part) and
    unit strides along K."""
    grid, args, constexprs, options, key, _ = _call(x2, packed, scales, s2, bias, out, cfg)
    _LAUNCHES(grid, args, constexprs, options, key)
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment; in the TMA form each call makes x's descriptor (x may be given with
    leading dimensions: it is viewed as x2's shape)."""
    grid, args, constexprs, options, key, make_x = _call(x2, packed, scales, s2, bias, out,
                                                         cfg)
    return _LAUNCHES.bind(grid, args, constexprs, options, key, args[0], out, make_x)


def _call(x2, packed, scales, s2, bias, out, cfg) -> tuple:
    """(grid, runtime args, constexprs, options, static key, x -> its descriptor or None
    where x is passed as itself) of one launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, w, x_regs = cfg["BN"], cfg["num_warps"], cfg.get("X_REGS", False)
    assert fits(m, k, cfg) and x2.stride(1) == 1 and packed.data_ptr() % 4 == 0, (m, k, cfg)
    assert bn in (16, 32, 64) and bn * 8 >= 32 * w, cfg  # at least a word a thread
    assert w == 4 or not x_regs, cfg  # X_REGS on one warpgroup: the form tested and picked
    bm = 16 * w  # 64 tokens a warpgroup
    wl, acc, sw = layouts(bn, w)
    if x_regs:
        make_x, xl = None, x_layout(w)
    else:
        assert tma_ready(x2), "x must be TMA-readable without X_REGS"
        shape = tuple(x2.shape)

        def make_x(x: torch.Tensor) -> TensorDescriptor:
            return TensorDescriptor.from_tensor(x.view(shape), [bm, 64], sw)

        xl = None
    x_src = x2 if make_x is None else make_x(x2)
    wide = not x_regs and wide_stores(n, out)
    shift = shifts_last_tile(m, bm) and not x_regs
    asm = words_asm(packed, wl)
    words = packed.view(torch.int32)
    has_bias = bias is not None
    return (
        (cdiv(n, bn), cdiv(m, bm)),
        (x_src, words, scales.view(torch.uint8), s2, bias if has_bias else out, out,
         m, n, x2.stride(0), words.stride(0), scales.stride(0), out.stride(0)),
        dict(HAS_BIAS=has_bias, BN=bn, BM=bm, KC=k // 64, OUT_LOG2=_DECODE[x2.dtype][1],
             WL=wl, ACC=acc, SW=sw, X_REGS=x_regs, XL=xl, WIDE=wide, WORDS_ASM=asm,
             SHIFT=shift),
        dict(num_warps=w), (has_bias, bn, w, k, x2.dtype, x_regs, wide, asm, shift), make_x)


_LAUNCHES = LaunchCache(_small_kernel)  # a memo of compiled launches, as Triton's own cache
