"""The pieces of the small-layer form that small_kernel.py and small_phased_kernel.py share.

The form: a program takes a tile of 16-32 weight rows (64 at most) over the whole of K and
64 or 128 tokens; every load of its weight rows (words, block scales, s2, the bias) is
issued at once, so it pays one memory latency; its weights are decoded once (the shared
word decode, 17 instructions per 8 weights, pairs in K order: gluon_common.NATURAL_PRMTS)
into shared memory, where wgmma reads them as its B operand, x being the A operand (the
tokens are the MMA's M, so the weight rows a program decodes can be few); the epilogue
stores each token's rows contiguously, 16 bytes a thread where the output allows it.

Here: the register and shared layouts (layouts), the weight rows' loads (load_rows,
word_pointers, load_words, with an L2 prefetch size where rows are 16-byte aligned:
words_prefetch), the decode into shared memory (decode_chunk, decode_to_shared), the
store (store_tokens), and where a program's token tile starts (tile_row0).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from .gluon_common import (
    L2_PREFETCH,
    NATURAL_ASM_BF16,
    NATURAL_ASM_F16,
    SCALE_ASM_BF16,
    SCALE_ASM_F16,
    halves,
    load_s2_bias,
    words_load_asm,
)


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


@gluon.jit
def register_k_order(t):
    """[R, 64] in memory K order -> the order X_REGS multiplies in: position 16 s + 8 h +
    2 q + e holds memory K 16 q + 4 s + 2 h + e (s: the 16-wide step, q: the fragment's
    column pair, h: its low or high half, e: the element of a pair)."""
    R: gl.constexpr = t.shape[0]
    t = gl.permute(gl.reshape(t, [R, 4, 4, 2, 2]), (0, 2, 3, 1, 4))
    return gl.reshape(t, [R, 64])


@gluon.jit
def decode_chunk(wd, sb, dtype: gl.constexpr):
    """Words [R, W] (int32; W = 8 is a chunk of 64 K) and each word's e4m3 block scale
    byte [R, W] -> the [R, 8 W] weights times their scale (pre-multiplied, as common.py
    says), in K order."""
    if dtype == gl.bfloat16:
        word_asm: gl.constexpr = NATURAL_ASM_BF16
        scale_asm: gl.constexpr = SCALE_ASM_BF16
    else:
        word_asm: gl.constexpr = NATURAL_ASM_F16
        scale_asm: gl.constexpr = SCALE_ASM_F16
    # the scale byte with a zero high byte: the conversion's low half is the scale
    pairs = gl.inline_asm_elementwise(scale_asm, "=r,h", [sb.to(gl.int16)], dtype=gl.int32,
                                      is_pure=True, pack=1)
    scale, _ = gl.split(halves(pairs, dtype))
    scale = gl.convert_layout(scale, wd.type.layout)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        word_asm, "=r,=r,=r,=r,r,h", [wd, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    # register j = 2o + i holds byte j's low (h = 0) and high nibble: K = 8 word + 2j + h
    w = gl.join(gl.join(halves(p0, dtype), halves(p1, dtype)),
                gl.join(halves(p2, dtype), halves(p3, dtype)))  # [BN, word, h, i, o]
    w = gl.permute(w, (0, 1, 4, 3, 2))  # [BN, word, o, i, h]
    return gl.reshape(w, [wd.shape[0], 8 * wd.shape[1]])


def words_prefetch(packed: torch.Tensor) -> int:
    """The word loads' L2 prefetch size in bytes (0: plain loads): L2_PREFETCH where every
    row's words start 16-byte aligned, so a thread's words go in one vector load."""
    aligned = packed.data_ptr() % 16 == 0 and packed.stride(0) % 16 == 0
    return L2_PREFETCH if aligned else 0


def words_asm(packed: torch.Tensor, wl: gl.BlockedLayout) -> str:
    """load_rows' word loads as PTX (gemv_kernel.words_load_asm): a thread's words of a
    chunk (wl) in one load with words_prefetch's hint; "" (plain loads) without one."""
    return words_load_asm(words_prefetch(packed), wl.size_per_thread[1])


@gluon.constexpr_function
def _words_constraints(per):
    return ",".join(["=r"] * per + ["l"] * per)


@gluon.jit
def load_rows(w_ptr, s_ptr, s2_ptr, bias_ptr, pid_n, N, stride_w, stride_s,
              HAS_BIAS: gl.constexpr, BN: gl.constexpr, KC: gl.constexpr,
              WL: gl.constexpr, ACC: gl.constexpr, WORDS_ASM: gl.constexpr):
    """Issue every load of program pid_n's BN weight rows: s2 and the bias (in the
    accumulator's row layout), then the words and block scale bytes of all KC chunks (in
    WL, all in flight before the first is used: load_words). Returns (words, scales,
    out_rows, s2, bias)."""
    w_ptrs, s_ptrs = word_pointers(w_ptr, s_ptr, pid_n * BN, N, stride_w, stride_s, BN, 8, WL)
    out_rows = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
    s2, bias = load_s2_bias(s2_ptr, bias_ptr, out_rows, N, HAS_BIAS)
    words, scales = load_words(w_ptrs, s_ptrs, 8, KC, WORDS_ASM)
    return words, scales, out_rows, s2, bias


@gluon.jit
def word_pointers(w_ptr, s_ptr, row0, N, stride_w, stride_s, R: gl.constexpr,
                  W: gl.constexpr, WL: gl.constexpr):
    """Pointers [R, W] (in WL) to the first W words of weight rows [row0, row0 + R)
    (clamped to N - 1) and to each word's block scale byte."""
    rows = gl.minimum(row0 + gl.arange(0, R, layout=gl.SliceLayout(1, WL)), N - 1)
    word = gl.arange(0, W, layout=gl.SliceLayout(0, WL))
    w_ptrs = w_ptr + rows[:, None].to(gl.int64) * stride_w + word[None, :]
    s_ptrs = s_ptr + rows[:, None].to(gl.int64) * stride_s + (word // 2)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def load_words(w_ptrs, s_ptrs, W: gl.constexpr, NL: gl.constexpr, WORDS_ASM: gl.constexpr):
    """Issue NL loads of W words a row from word_pointers' pointers (load i: words
    [W i, W i + W), so with W = 8 chunk i) and of their scale bytes, all in flight before
    the first is used. Returns (words, scales), tuples of NL tensors.

    WORDS_ASM (words_asm): the word loads ask L2 to fetch the 128 bytes around them, so a
    row's DRAM reads come in fewer, larger pieces. A program reads its rows' whole K, so
    nothing fetched goes unused. Outputs are bit-equal either way."""
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
def decode_to_shared(words, scales, SW: gl.constexpr, dtype: gl.constexpr,
                     X_REGS: gl.constexpr):
    """Each chunk's decoded [BN, 64] weights in its own shared buffer (wgmma's B), in K
    order or, for X_REGS, in register_k_order; fenced for the async reads. The first
    barrier pins the loads issued before it ahead of the decode."""
    gl.thread_barrier()
    w_bufs = ()
    for c in gl.static_range(len(words)):
        w = decode_chunk(words[c], scales[c], dtype)
        if X_REGS:
            w = register_k_order(w)
        w_bufs = w_bufs + (gl.allocate_shared_memory(dtype, [words[c].shape[0], 64], SW, w),)
    fence_async_shared()  # the generic stores above before wgmma's async reads
    gl.thread_barrier()
    return w_bufs


@gluon.jit
def store_tokens(acc, row0, first, out_rows, s2, bias, out_ptr, M, N, stride_om,
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
    fill their sectors. Bit-equal either way. At 1-32 tokens (X_REGS) the move's barrier
    costs more than it saves on a kernel of ~3 us, so those keep the accumulator's
    layout, and so do outputs the 16-byte stores do not fit (wide_stores decides on the
    host).

    The row indices go with the tile through shared memory too, or with ROWS_MADE are
    made in the store's layout from the first: small_phased_kernel passes ROWS_MADE (it is
    faster there), small_kernel does not (it is slower on most of its shapes)."""
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
    repeat the tile before it and are not stored (store_tokens' first); a row of the
    product depends on its own row of x alone, so the outputs are bit-equal. Boxes past
    M (the TMA unit fills those rows with zeros) cost a program up to several us on long
    K."""
    row0 = pid_m * BM
    if SHIFT:
        # M > BM, so the clamp at 0 never binds: it compiles into the min (min.relu) and
        # tells the compiler row0 is not negative
        row0 = gl.maximum(gl.minimum(row0, M - BM), 0)
    return row0


def wide_stores(n: int, out: torch.Tensor) -> bool:
    """Whether the epilogue takes store_tokens' 16-byte stores: where Triton's
    specialization tells the compiler that N and out's row stride are multiples of 16
    (otherwise the row mask may change within a thread's eight rows and the stores would
    split into 2-byte ones, so those keep the accumulator's layout)."""
    return n % 16 == 0 and out.stride(0) % 16 == 0 and out.data_ptr() % 16 == 0

