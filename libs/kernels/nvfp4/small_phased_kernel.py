"""NVFP4 weight-only linear for small layers with K past small_configs.MAX_K in Gluon:
small_kernel's form (small_form.py: x as wgmma's A operand, 16, 24 or 32 weight rows a
program decoded once into shared memory) with x streamed through a ring of shared buffers.

The routing table (routing.py) sends it small layers whose K is whole 256-wide phases,
past triton_configs.few_tokens (SmolLM2's down projection, 576 x 1536, from 33 tokens),
while its programs fit in one wave (small_phased_configs.pick_config).

One program's x tile is 64 tokens x K x 2 bytes: 196 KB at SmolLM2's down projection,
past what shared memory holds beside the decoded weights. So the weights of all K are
loaded at once and decoded up front (BN x K x 2 bytes: 48 KB at 16 rows, 96 KB at 32),
while x arrives by TMA in XS slots of XC chunks (64 K each), one box a slot (x viewed as
[chunk, token, K in chunk]); phase p multiplies slot p % XS, and once its wgmmas are
issued the slot phase p - 1 used is refilled with phase p - 1 + XS's chunks, after a wait
that leaves only phase p's wgmmas in flight. At 24 rows with two or more refilled phases
(SmolLM2's down projection at 193-256 tokens) the decode is split in three groups
instead, so that the refills go out before it ends (small_phased_configs.split_decode).
Up to 32 tokens x comes in boxes of 32 rows, one per chunk (small_phased_configs.x_rows).

24 rows (BN = 24) run in a 32-row tile whose last 8 rows are never decoded
(_decode_rows24): the wgmma is the 32-row one, x is read once a chunk, and a program loads
and decodes three quarters of what a 32-row one does. That is the pick where 16 rows take
more than one wave and 24 do not (SmolLM2's down projection at 193-256 tokens: 96
programs against 72 of 32 rows, which are slower). A 24-row form that multiplies the 8
rows by a wgmma of their own reads x twice a chunk, and is slower.

Where a slot is one box (64-token tiles), x's first XS boxes go out before the weights'
loads; with 32-row boxes (XC copies a slot, each behind a barrier Triton puts before every
TMA copy) the loads go first, as in small_kernel. Each ring slot has its own barrier
allocation: Triton orders accesses to one allocation with CTA barriers, so one [XS]
allocation would put a bar.sync before every phase's wait.

Numerics equal small_kernel's (the same exact decoded weights, fp32 accumulation, s2 and
the power of two in the epilogue).
"""

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

from .common import DECODE, tma_ready
from .gluon_common import load_s2_bias
from .grid import cdiv, shifts_last_tile
from .launch_cache import Launch, LaunchCache
from .small_form import (
    decode_chunk,
    decode_to_shared,
    layouts,
    load_rows,
    load_words,
    store_tokens,
    tile_row0,
    wide_stores,
    word_pointers,
    words_asm,
)
from .small_phased_configs import XC, fits, ring_slots, split_decode, x_rows

# a slot's box [XC, 64 tokens, 64 K], 128-byte swizzled as wgmma reads each [64, 64] tile
_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
# BN = 24: the words of 8 rows, two chunks a load ([8, 16]), one a thread on 4 warps
_WL8 = gl.BlockedLayout([1, 1], [2, 16], [4, 1], [1, 0])


@gluon.jit
def _fill(x_desc, x_ring, bars, slot: gl.constexpr, phase: gl.constexpr, row,
          XC: gl.constexpr, XR: gl.constexpr):
    """TMA phase `phase`'s XC x chunks into ring slot `slot`, arriving on the slot's
    barrier: one box [XC, BM, 64] (x viewed as [chunk, token, K in chunk]) with XR = BM,
    else a [XR, 64] box per chunk into its tile's first XR rows (one token tile, M <= XR:
    the rows after them are never written: they feed only accumulator rows >= XR, which
    the store masks, as a row of the product depends on its own row of x alone)."""
    if XR == x_ring[slot].shape[1]:
        mbarrier.expect(bars[slot], x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [phase * XC, row, 0], bars[slot],
                                        x_ring[slot])
    else:
        mbarrier.expect(bars[slot], XC * x_desc.block_type.nbytes)
        for j in gl.static_range(XC):
            tma.async_copy_global_to_shared(x_desc, [row, (phase * XC + j) * 64],
                                            bars[slot], x_ring[slot].index(j).slice(0, XR))


@gluon.jit
def _start_ring(x_desc, row0, BM: gl.constexpr, XC: gl.constexpr, XS: gl.constexpr,
                XR: gl.constexpr, NP: gl.constexpr, SW: gl.constexpr):
    """Allocate the ring's XS slots and their barriers and fill the first phases' with
    the tile's tokens (row0 on). Returns (the slots as TMA writes them, the same as wgmma
    reads them, the barriers)."""
    dtype: gl.constexpr = x_desc.dtype
    # a slot per allocation in the box's 3D layout, read by wgmma as [BM, 64] tiles
    x_ring = ()
    x_tiles = ()
    for _ in gl.static_range(XS):
        if XR == BM:
            slot = gl.allocate_shared_memory(dtype, [XC, BM, 64], x_desc.layout)
            x_ring = x_ring + (slot,)
            x_tiles = x_tiles + (slot._reinterpret(dtype, [XC, BM, 64], SW),)
        else:  # per-chunk 2D boxes: the slot in the 2D tiles' layout
            slot = gl.allocate_shared_memory(dtype, [XC, BM, 64], SW)
            x_ring = x_ring + (slot,)
            x_tiles = x_tiles + (slot,)
    # a barrier per allocation: Triton orders accesses to one allocation with CTA
    # barriers, so one [XS] allocation would put a bar.sync before every phase's wait
    bars = ()
    for _ in gl.static_range(XS):
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        bars = bars + (bar,)
    fence_async_shared()
    for s in gl.static_range(XS):
        if s < NP:
            _fill(x_desc, x_ring, bars, s, s, row0, XC, XR)
    return x_ring, x_tiles, bars


@gluon.jit
def _decode_rows24(words, scales, words8, scales8, C0: gl.constexpr, C1: gl.constexpr,
                   SW: gl.constexpr, BOX: gl.constexpr, dtype: gl.constexpr):
    """BN = 24's decoded weights for chunks [C0, C1) (both even): one [32, 64] buffer a
    chunk (wgmma's B) whose rows 24-31 are never written; they feed only accumulator
    columns 24-31, which the store masks (a column of the product depends on its own
    weight row alone). Rows 0-15 come from `words` ([16, 8] a chunk), rows 16-23 from
    `words8` ([8, 16]: chunks 2c and 2c + 1 in one load, so a thread still holds one
    word). A chunk pair is one allocation in x's box layout, so that its rows 16-23 are
    one [2, 8, 64] view. Fenced for the async reads; from chunk 0, a first barrier pins the
    loads issued before it ahead of the decode."""
    if C0 == 0:
        gl.thread_barrier()
    boxes = ()
    pairs = ()
    for _ in gl.static_range((C1 - C0) // 2):
        box = gl.allocate_shared_memory(dtype, [2, 32, 64], BOX)
        boxes = boxes + (box,)
        pairs = pairs + (box._reinterpret(dtype, [2, 32, 64], SW),)
    # Triton's barrier analysis compares byte ranges, and a pair's rows 16-23 span its
    # second chunk's rows 0-15: in this order it puts one barrier among the stores, not
    # one a pair (rows 16-23 of every pair, then rows 0-15 of every first chunk, then of
    # every second chunk)
    for c in gl.static_range(C0 // 2, C1 // 2):
        w = decode_chunk(words8[c], scales8[c], dtype)  # [8, 128]: chunks 2c, 2c + 1
        boxes[c - C0 // 2].slice(16, 8, dim=1).store(
            gl.permute(gl.reshape(w, [8, 2, 64]), (1, 0, 2)))
    for h in gl.static_range(2):
        for c in gl.static_range(C0 + h, C1, 2):
            pairs[(c - C0) // 2].index(h).slice(0, 16).store(
                decode_chunk(words[c], scales[c], dtype))
    fence_async_shared()  # the generic stores above before wgmma's async reads
    gl.thread_barrier()
    w_bufs = ()
    for c in gl.static_range(C1 - C0):
        w_bufs = w_bufs + (pairs[c // 2].index(c % 2),)
    return w_bufs


@gluon.jit
def _phases(acc, x_tiles, bars, w_bufs, W0: gl.constexpr, P0: gl.constexpr,
            P1: gl.constexpr, XC: gl.constexpr, XS: gl.constexpr):
    """Wait for phases [P0, P1)'s x and issue their wgmmas; w_bufs start at chunk W0."""
    for p in gl.static_range(P0, P1):
        mbarrier.wait(bars[p % XS], (p // XS) % 2)
        for j in gl.static_range(XC):
            acc = warpgroup_mma(x_tiles[p % XS].index(j),
                                w_bufs[p * XC + j - W0].permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _phased_kernel(
    x_desc, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr,
    M, N, stride_w, stride_s, stride_om,  # w in int32 words, s in bytes
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
    XC: gl.constexpr, XS: gl.constexpr, XR: gl.constexpr, OUT_LOG2: gl.constexpr,
    WL: gl.constexpr, ACC: gl.constexpr, SW: gl.constexpr, WIDE: gl.constexpr,
    WORDS_ASM: gl.constexpr, SHIFT: gl.constexpr, WL8: gl.constexpr, BOX: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """out[tokens, rows] for 64 tokens and BN weight rows, as small_kernel's, with x in
    NP phases through the ring; BN = 24 in a 32-column tile (_decode_rows24). SPLIT
    (split_decode): the decode in three groups, so that the ring's refills go out before
    the decode ends."""
    NP: gl.constexpr = KC // XC  # phases
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    row0 = tile_row0(pid_m, M, BM, SHIFT)
    dtype: gl.constexpr = x_desc.dtype
    # Which goes out first, x's copies or the weights' loads (see the module doc): x's
    # where a slot is one box, the weights' where it is XC copies, each behind a barrier.
    if XR == BM:
        x_ring, x_tiles, bars = _start_ring(x_desc, row0, BM, XC, XS, XR, NP, SW)
    if BN == 24:
        # 16 rows a chunk as BN = 16 loads them, 8 rows two chunks a load; the store's N
        # ends at the program's 24th row
        col0 = pid_n * 24
        n_end = gl.minimum(N, col0 + 24)
        w_ptrs, s_ptrs = word_pointers(w_ptr, s_ptr, col0, N, stride_w, stride_s, 16, 8, WL)
        w8_ptrs, s8_ptrs = word_pointers(w_ptr, s_ptr, col0 + 16, N, stride_w, stride_s, 8, 16,
                                         WL8)
        out_rows = col0 + gl.arange(0, 32, layout=gl.SliceLayout(0, ACC))
        s2, bias = load_s2_bias(s2_ptr, bias_ptr, out_rows, n_end, HAS_BIAS)
        words, scales = load_words(w_ptrs, s_ptrs, 8, KC, WORDS_ASM)
        words8, scales8 = load_words(w8_ptrs, s8_ptrs, 16, KC // 2, WORDS_ASM)
    else:
        col0 = pid_n * BN
        n_end = N
        words, scales, _, s2, bias = load_rows(  # rows: made at the store
            w_ptr, s_ptr, s2_ptr, bias_ptr, pid_n, N, stride_w, stride_s, HAS_BIAS, BN, KC, WL,
            ACC, WORDS_ASM)
    if XR != BM:
        x_ring, x_tiles, bars = _start_ring(x_desc, row0, BM, XC, XS, XR, NP, SW)
    acc = gl.zeros([BM, tile_rows(BN)], gl.float32, ACC)
    if SPLIT:
        # phases [0, G) decoded and issued; [G, XS) decoded while those run; then the
        # slots of [0, G) refilled with phases XS to NP - 1 (G = NP - XS) and [G, XS)
        # issued; the rest decoded while the refills arrive (the first group's buffers
        # are free by then: the wait names them, so they stay allocated until it)
        G: gl.constexpr = NP - XS
        wa = _decode_rows24(words, scales, words8, scales8, 0, G * XC, SW, BOX, dtype)
        acc = _phases(acc, x_tiles, bars, wa, 0, 0, G, XC, XS)
        wb = _decode_rows24(words, scales, words8, scales8, G * XC, XS * XC, SW, BOX, dtype)
        acc = warpgroup_mma_wait(0, deps=(acc,) + wa)[0]
        gl.thread_barrier()
        for q in gl.static_range(G):
            _fill(x_desc, x_ring, bars, q, XS + q, row0, XC, XR)
        acc = _phases(acc, x_tiles, bars, wb, G * XC, G, XS, XC, XS)
        wc = _decode_rows24(words, scales, words8, scales8, XS * XC, KC, SW, BOX, dtype)
        acc = _phases(acc, x_tiles, bars, wc, XS * XC, XS, NP, XC, XS)
        acc = warpgroup_mma_wait(0, deps=(acc,) + wb + wc)[0]
    else:
        if BN == 24:
            w_bufs = _decode_rows24(words, scales, words8, scales8, 0, KC, SW, BOX, dtype)
        else:
            w_bufs = decode_to_shared(words, scales, SW, dtype, False)
        for p in gl.static_range(NP):
            acc = _phases(acc, x_tiles, bars, w_bufs, 0, p, p + 1, XC, XS)
            if p >= 1:
                if p - 1 + XS < NP:
                    # only phase p's wgmmas may still read the ring: phase p - 1's slot is
                    # free
                    acc = warpgroup_mma_wait(XC, deps=(acc,))
                    gl.thread_barrier()
                    _fill(x_desc, x_ring, bars, (p - 1) % XS, p - 1 + XS, row0, XC, XR)
        acc = warpgroup_mma_wait(0, deps=(acc,))
    store_tokens(acc, row0, pid_m * BM, col0, s2, bias, out_ptr, M, n_end, stride_om,
                 HAS_BIAS, OUT_LOG2, WIDE, ROWS_MADE=True)
    # after the stores, which is faster than before them
    for s in gl.static_range(XS):
        mbarrier.invalidate(bars[s])


@gluon.constexpr_function
def tile_rows(bn):
    """The weight rows of a program's tile: BN, or 32 for BN = 24 (_decode_rows24); at
    compile time what small_phased_configs.tile_rows gives the host."""
    return 32 if bn == 24 else bn


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BN, num_warps=4); requires
    fits(M, K, cfg), x TMA-readable, packed readable as int32 words, and unit strides
    along K."""
    grid, args, constexprs, options, key, _ = _call(x2, packed, scales, s2, bias, out, cfg)
    _LAUNCHES(grid, args, constexprs, options, static_key=key)
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment; each call makes x's descriptor (x may be given with leading
    dimensions: it is viewed as x2's shape)."""
    grid, args, constexprs, options, key, make_x = _call(x2, packed, scales, s2, bias, out,
                                                         cfg)
    return _LAUNCHES.bind(grid, args, constexprs, options, key, args[0], out, make_x)


def _call(x2, packed, scales, s2, bias, out, cfg) -> tuple:
    """(grid, runtime args, constexprs, options, static key, x -> its descriptor)."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, w = cfg["BN"], cfg.get("num_warps", 4)
    assert fits(m, k, cfg) and tma_ready(x2) and packed.data_ptr() % 4 == 0, (m, k, cfg)
    assert w == 4 and bn in (16, 24, 32), cfg
    bm = 64
    if bn == 24:  # 16 rows in BN = 16's words layout, 8 in _WL8, a 32-column accumulator
        (wl, _, _), (_, acc, sw), wl8 = layouts(16, w), layouts(32, w), _WL8
        assert wl8.size_per_thread == wl.size_per_thread  # one WORDS_ASM serves both
    else:
        (wl, acc, sw), wl8 = layouts(bn, w), None
    # x as [chunk, token, K in chunk]: a slot's XC chunks are one TMA box (one copy, where
    # four would be slower)
    xr = x_rows(m)
    shape, row_stride = (m, k), x2.stride(0)
    if xr == bm:
        def make_x(x: torch.Tensor) -> TensorDescriptor:
            x3 = x.view(shape).as_strided((k // 64, m, 64), (64, row_stride, 1))
            return TensorDescriptor.from_tensor(x3, [XC, bm, 64], _BOX_LAYOUT)
    else:
        def make_x(x: torch.Tensor) -> TensorDescriptor:
            return TensorDescriptor.from_tensor(x.view(shape), [xr, 64], sw)
    words = packed.view(torch.int32)
    has_bias = bias is not None
    wide = wide_stores(n, out)
    asm = words_asm(packed, wl)
    xs = ring_slots(k, bn, xr == bm)
    shift = shifts_last_tile(m, bm)
    split = split_decode(k, bn, xr, xs)
    return (
        (cdiv(n, bn), cdiv(m, bm)),
        (make_x(x2), words, scales.view(torch.uint8), s2, bias if has_bias else out, out,
         m, n, words.stride(0), scales.stride(0), out.stride(0)),
        dict(HAS_BIAS=has_bias, BN=bn, BM=bm, KC=k // 64, XC=XC, XS=xs, XR=xr,
             OUT_LOG2=DECODE[x2.dtype][1], WL=wl, ACC=acc, SW=sw, WIDE=wide, WORDS_ASM=asm,
             SHIFT=shift, WL8=wl8, BOX=_BOX_LAYOUT, SPLIT=split),
        dict(num_warps=w), (has_bias, bn, w, k, xr, x2.dtype, wide, asm, xs, shift, split),
        make_x)


_LAUNCHES = LaunchCache(_phased_kernel)  # a memo of compiled launches, as Triton's own cache
