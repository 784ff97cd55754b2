"""NVFP4 weight-only linear for small layers with K past 576 in Gluon: small_kernel's form
(x as wgmma's A operand, 16, 24 or 32 weight rows a program decoded once into shared
memory) with x streamed through a ring of shared buffers.

One program's x tile is 64 tokens x K x 2 bytes: 196 KB at SmolLM2's down projection
(576 x 1536), past what shared memory holds beside the decoded weights. So the weights of
all K are loaded at once and decoded up front (BN x K x 2 bytes: 48 KB at 16 rows, 96 KB
at 32), while x arrives by TMA in XS slots of XC chunks (64 K each), one box a slot (x
viewed as [chunk, token, K in chunk]); phase p multiplies slot p % XS, and once its
wgmmas are issued the slot phase p - 1 used is refilled with phase p - 1 + XS's chunks,
after a wait that leaves only phase p's wgmmas in flight. At 24 rows with two or more
refilled phases (SmolLM2's down projection at 193-256 tokens) the decode is split in
three groups instead, so that the refills go out before it ends (split_decode).

Session `epilogue` (docs/notes/nvfp4-triton.md; two to three runs of five interleaved
rounds on H100s, as no H200 came), bit-equal to the kernel before it, us (torch): 576 x
1536 at M = 256 / 224 / 193 5.07 / 5.12 / 5.09 against 5.20 / 5.46 / 5.39 (5.30 / 5.22 /
5.28). The split decode is 0.09-0.13 us of it (the same kernel forced to decode up
front: 5.21 / 5.20 / 5.17); at 193-224 tokens the rest comes from three changes that
tie at 256: a barrier allocation per ring slot (Triton orders accesses to one
allocation with CTA barriers: 28 bar.sync a program became 15), the output rows made in
the store's layout (_store_tokens' ROWS_MADE), the barriers' invalidations after the
stores.

24 rows (BN = 24) run in a 32-row tile whose last 8 rows are never decoded
(_decode_rows24): the wgmma is the 32-row one, x is read once a chunk, and a program loads
and decodes three quarters of what a 32-row one does. Where 16 rows take more than one
wave and 24 do not (SmolLM2's down projection at 193-256 tokens: 96 programs against 72
of 32 rows), bit-equal; five interleaved rounds on two H200s (docs/notes/nvfp4-triton.md,
session `rows24`), us, 24 rows against 32 (torch):
- 576 x 1536 at M = 256: 5.21 against 5.62 (5.21), and through the route 5.35 against
  5.69 (5.27); M = 224 5.46 / 5.47 against 5.75 / 5.80 (5.27 / 5.38); M = 193 5.48
  against 5.80 (5.31);
- 576 x 1280 at M = 193 / 224 / 256 4.76 / 4.80 / 4.84 against 4.95 / 4.96 / 4.98 (5.03 /
  5.01 / 4.87); 576 x 1024 at M = 193 / 224 4.40 / 4.41 against 4.48 / 4.48, at M = 256
  4.41 against 4.38 (4.54).
A 24-row form that multiplies the 8 rows by a wgmma of their own reads x twice a chunk
and lost (6.8 us at 576 x 1536, session `long-light`); so did small_kernel's 24 rows on
two warpgroups for gate/up (1536 x 576 at M = 256 4.55 against 4.23: rows 0-15 two chunks
a load and rows 16-23 four, 7 words a thread against 9; session `rows24`).

Measured on an H200 (docs/notes/nvfp4-triton.md, session `phases`), 576 x 1536, three
interleaved rounds in the bench's graph timer: M = 64 ~5.0 us against 5.26-5.33 for
linear_kernels' Triton kernel (torch 5.06-5.13), M = 128 ~5.0 against 6.28-6.33
(5.14-5.21), M = 256 (32 rows, 72 programs) 5.79 against the GEMM's 6.42-6.50 (5.24).
At 1-16 tokens the Triton kernel stays faster (4.59-4.64 against 5.08-5.10). Up to 32
tokens x comes in boxes of 32 rows, one per chunk (x_rows): 4.68-4.70 us at 17-32 tokens
against 5.01-5.10 with the 64-row box (torch 4.99-5.05; session `boxes`); since session
`ring-sweep` 17-32 tokens go to the Triton kernel where K is 2048 or more, and at 1536
where its programs fit in one wave (linear_kernels.few_tokens), and since session
`long-light` 33-128 tokens where K is 2048 or more under 2^27 multiply-adds
(long_and_light). A copy per
chunk instead of per slot: 4.93-5.13 at 32-192 tokens, 6.34 at 256. Shallower rings lost
(3 slots of 2 chunks 5.45-5.47 us at M = 64-128, 2 of 4 5.79), so did 128-token tiles on
one or two warpgroups (7.0-9.7) and K split across two warpgroups (6.4-8.8).

Where a slot is one box (64-token tiles), x's first XS boxes go out before the weights'
loads; with 32-row boxes (XC copies a slot, each behind a barrier Triton 3.6 puts before
every TMA copy) the loads go first, as in small_kernel. Bit-equal either way; seven
interleaved rounds on an H200 (docs/notes/nvfp4-triton.md, session `register-a`), us, x
first against loads first (torch): 576 x 1536 at M = 64 / 128 / 256 5.06 / 5.04 / 5.75
against 5.11 / 5.14 / 5.78 (5.17 / 5.24 / 5.33), 512 x 2048 at M = 256 6.04 against 6.30
(6.00), 960 x 1536 at M = 128 5.24 against 5.37 (5.30); 1024 x 1024 at M = 256 loses 0.06
(4.79 against 4.73). At 17-32 tokens x first lost 0.13-0.52 us (two runs).

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

from .gemv_kernel import _load_s2_bias
from .grid import cdiv, shifts_last_tile
from .launch_cache import Launch, LaunchCache
from .linear_kernels import _DECODE, few_tokens
from .small_kernel import (
    _decode_chunk,
    _decode_to_shared,
    _load_rows,
    _load_words,
    _store_tokens,
    _word_pointers,
    layouts,
    tile_row0,
    tma_ready,
    wide_stores,
    words_asm,
)

XC = 4  # chunks of 64 K a ring slot
XS = 3  # ring slots: 3 x 4 x 64 tokens x 64 x 2 bytes = 96 KB of x (ring_slots: 4-5 at times)
SMEM_BYTES = 226 * 1024  # ring_slots' bound on the decoded weights and the ring (H200: 227 KB)
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
    # barriers, so one [XS] allocation put a bar.sync before every phase's wait (28
    # against 15 in a program at 576 x 1536, M = 256)
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
        w = _decode_chunk(words8[c], scales8[c], dtype)  # [8, 128]: chunks 2c, 2c + 1
        boxes[c - C0 // 2].slice(16, 8, dim=1).store(
            gl.permute(gl.reshape(w, [8, 2, 64]), (1, 0, 2)))
    for h in gl.static_range(2):
        for c in gl.static_range(C0 + h, C1, 2):
            pairs[(c - C0) // 2].index(h).slice(0, 16).store(
                _decode_chunk(words[c], scales[c], dtype))
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
        w_ptrs, s_ptrs = _word_pointers(w_ptr, s_ptr, col0, N, stride_w, stride_s, 16, 8, WL)
        w8_ptrs, s8_ptrs = _word_pointers(w_ptr, s_ptr, col0 + 16, N, stride_w, stride_s, 8, 16,
                                          WL8)
        out_rows = col0 + gl.arange(0, 32, layout=gl.SliceLayout(0, ACC))
        s2, bias = _load_s2_bias(s2_ptr, bias_ptr, out_rows, n_end, HAS_BIAS)
        words, scales = _load_words(w_ptrs, s_ptrs, 8, KC, WORDS_ASM)
        words8, scales8 = _load_words(w8_ptrs, s8_ptrs, 16, KC // 2, WORDS_ASM)
    else:
        col0 = pid_n * BN
        n_end = N
        words, scales, _, s2, bias = _load_rows(  # rows: made at the store
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
            w_bufs = _decode_to_shared(words, scales, SW, dtype, False)
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
    _store_tokens(acc, row0, pid_m * BM, col0, s2, bias, out_ptr, M, n_end, stride_om,
                  HAS_BIAS, OUT_LOG2, WIDE, ROWS_MADE=True)
    # after the stores, as measured faster (docs/notes/nvfp4-triton.md, session `epilogue`)
    for s in gl.static_range(XS):
        mbarrier.invalidate(bars[s])


@gluon.constexpr_function
def tile_rows(bn):
    """The weight rows of a program's tile: BN, or 32 for BN = 24 (_decode_rows24)."""
    return 32 if bn == 24 else bn


def _shared_bytes(bn: int, k: int, slots: int) -> int:
    """The decoded weights (tile_rows(BN) x K x 2 bytes) and the ring's slots of x."""
    return tile_rows(bn) * k * 2 + slots * XC * 64 * 64 * 2


def ring_slots(k: int, bn: int, one_box: bool) -> int:
    """x's ring slots: a deeper ring where K is five or six phases (1280 or 1536; six is
    SmolLM2's down projection), 4 slots where a slot is one box (64-token tiles) and 5
    where it is XC 32-row copies (17-32 tokens), the most of those that fit beside the
    decoded weights (5 slots at 16 rows, 4 at 32 rows: 229,408 bytes); else XS.
    Bit-equal; five interleaved rounds on an H200 (docs/notes/nvfp4-triton.md, sessions
    `register-a` and `ring-sweep`), us, slots 3 / 4 / 5 (torch):
    - 576 x 1536, M = 17 / 32: 4.83 / 4.67 / 4.52 and 4.82 / 4.65 / 4.55 (4.99 / 5.06);
      M = 64 / 128: 4.94 / 4.65 / 4.80 and 4.93 / 4.66 / 4.79 (5.08 / 5.15);
    - 576 x 1280, M = 17 / 32: 4.26 / 4.10 / 4.05 and 4.25 / 4.10 / 4.06 (4.66 / 4.73);
      M = 64 / 128: 4.53 / 4.09 / 4.28 and 4.51 / 4.15 / 4.32 (4.75 / 4.81);
    - M = 256 ties (5.66 / 5.64 at 576 x 1536, 4.98 / 4.96 at 576 x 1280).
    Other K keep 3: at four phases (1024 x 1024) 4 slots tied up to M = 128 and lost at 256
    (4.74 against 4.56); at eight (512 x 2048) 4 slots won 0.05-0.14 at M = 64-256 in one
    run and lost 0.05-0.07 in another, and 32-row slots lost 0.4 us with 4 or 5."""
    want = (4 if one_box else 5) if k // (64 * XC) in (5, 6) else XS
    return next((s for s in range(want, XS, -1) if _shared_bytes(bn, k, s) <= SMEM_BYTES), XS)


def split_decode(k: int, bn: int, xr: int, slots: int) -> bool:
    """Whether _phased_kernel decodes in three groups (SPLIT) instead of all at once: at
    BN = 24 with 64-token boxes, where at least two phases wait for a refill of the
    ring (SmolLM2's down projection: six phases, four slots). All-at-once, the refills
    go out only after the whole decode and the first phase's wgmmas, so the last
    phases' x arrives late (a probe that skipped the refills ran 0.36 us faster at
    576 x 1536, M = 256). Split, phases 0-1 are decoded and issued first, 2-3 decoded
    while they run, then slots 0-1 refilled, 2-3 issued and 4-5 decoded while their x
    arrives. Bit-equal; five interleaved rounds on an H100 (docs/notes/nvfp4-triton.md,
    session `epilogue`), us, split against all at once (torch): 576 x 1536 at M = 256 /
    224 / 193 5.03 / 5.05 / 5.02 against 5.15 / 5.14 / 5.12 (5.27 / 5.18 / 5.45). With one
    refilled phase (576 x 1280) it was mixed: 4.57 against 4.74 at M = 256, 4.56 against
    4.48 at M = 224. The first group's phases must all be in the ring at the start (fewer
    refilled phases than slots)."""
    refilled = k // (64 * XC) - slots
    return bn == 24 and xr == 64 and 2 <= refilled < slots


def x_rows(m: int) -> int:
    """Token rows of x's TMA box: 32 up to 32 tokens, else a whole tile of 64. The box's
    size costs, not the rows read: 576 x 1536 took 4.68-4.70 us at 17-32 tokens with
    32-row boxes against 5.01-5.10 with 64-row ones (5.01 at 64 tokens, no row past M);
    session `boxes`. Gluon's TMA boxes have power-of-two rows, so 33-63 tokens keep 64."""
    return 32 if m <= 32 else 64


def fits(m: int, k: int, cfg: dict) -> bool:
    """K in whole phases of XC chunks, at least XS of them, the weights' shared memory
    (BN x K x 2 bytes) beside the ring under 227 KB."""
    bn = cfg.get("BN", 16)
    return (k % (64 * XC) == 0 and k // (64 * XC) >= XS
            and _shared_bytes(bn, k, XS) <= 220 * 1024)


def readable(x2: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether x makes a TMA descriptor (at every M: this kernel has no register path for
    x) and packed can be read as int32 words."""
    return tma_ready(x2) and packed.data_ptr() % 4 == 0


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where another kernel runs:
    linear_kernels.few_tokens (1-16 tokens, and 17-32 where K is 2048 or more, or 1536
    with that kernel's programs in one wave: its Triton kernel measured faster), layers
    of 2^22 weights or more, K this kernel does not fit, and token counts past one wave at
    32 rows. The fewest rows (16, then 24, then 32) whose programs fit in one wave, as
    small_kernel picks: at M = 256 on 576 x 1536 16 rows take 144 programs (8.68-8.75 us),
    24 rows 96 (5.21) and 32 rows 72 (5.62; the module doc). Also declined: the calls
    long_and_light names."""
    if few_tokens(m, n, k, sms) or n * k >= 2**22 or long_and_light(m, n, k):
        return None
    for bn in (16, 24, 32):
        cfg = dict(BN=bn, num_warps=4)
        if fits(m, k, cfg) and cdiv(n, bn) * cdiv(m, 64) <= sms:
            return cfg
    return None


def long_and_light(m: int, n: int, k: int) -> bool:
    """Whether linear_kernels' Triton kernel (its own config for m tokens) takes a call
    past few_tokens' 32 tokens: K of 2048 or more (eight phases and up, a long chain a
    program) at up to 128 tokens and under 2^27 multiply-adds, where that kernel, which
    splits K over more programs, keeps the call (from 2^27 dequantize_route takes its
    calls). Its outputs are exact to the same bound, not bit-equal to this kernel's. A/B
    through the route on one H200, five interleaved rounds (docs/notes/nvfp4-triton.md,
    session `long-light`), us, after against before (torch):
    - 512 x 2048 at M = 33 / 48 / 64 / 96: 5.04 / 5.03 / 5.14 / 5.95 against 6.18 / 5.88 /
      5.89 / 6.85 (5.82 / 5.76 / 5.78 / 5.80);
    - 960 x 2560 (SmolLM2-360M's down projection) at M = 33 / 48: 6.13 / 6.22 against
      8.63 / 7.63 (6.56 / 6.57); 768 x 3072: 6.32 / 6.35 against 9.39 / 8.44 (8.09 / 7.99);
    - 1024 x 2048 at M = 33 / 48: 6.08 / 6.11 against 7.22 / 6.33; 1536 x 2048 at M = 33:
      7.04 against 8.23;
    - 256 x 2048 at M = 33-128: 4.91-5.10 against 5.77-5.83 (5.72-5.75).
    This kernel keeps the calls past the bound, and wins some outright in a probe of both
    kernels: 1024 x 2048 at M = 64 5.93 against 6.12, 1536 x 2048 at M = 48 / 64 6.72 /
    6.11 against 7.32 / 7.35, and 129-256 tokens."""
    return k >= 2048 and 32 < m <= 128 and m * n * k < 2**27


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BN, num_warps=4); requires
    fits(M, K, cfg), readable(x2, packed) and unit strides along K."""
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
    assert fits(m, k, cfg) and readable(x2, packed) and w == 4 and bn in (16, 24, 32), (m, k, cfg)
    bm = 64
    if bn == 24:  # 16 rows in BN = 16's words layout, 8 in _WL8, a 32-column accumulator
        (wl, _, _), (_, acc, sw), wl8 = layouts(16, w), layouts(32, w), _WL8
        assert wl8.size_per_thread == wl.size_per_thread  # one WORDS_ASM serves both
    else:
        (wl, acc, sw), wl8 = layouts(bn, w), None
    # x as [chunk, token, K in chunk]: a slot's XC chunks are one TMA box (one copy of
    # four chunks took 5.79 us at M = 256 against 6.34 for four copies)
    xr = cfg.get("XR") or x_rows(m)
    assert xr == bm or (m <= xr and xr in (16, 32)), (m, cfg)
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
    split = cfg.get("SPLIT", split_decode(k, bn, xr, xs))  # forced only by tests
    # forced, it takes one refilled phase or more (split_decode picks two or more)
    assert not split or (bn == 24 and xr == bm and 0 < k // (64 * XC) - xs < xs), cfg
    return (
        (cdiv(n, bn), cdiv(m, bm)),
        (make_x(x2), words, scales.view(torch.uint8), s2, bias if has_bias else out, out,
         m, n, words.stride(0), scales.stride(0), out.stride(0)),
        dict(HAS_BIAS=has_bias, BN=bn, BM=bm, KC=k // 64, XC=XC, XS=xs, XR=xr,
             OUT_LOG2=_DECODE[x2.dtype][1], WL=wl, ACC=acc, SW=sw, WIDE=wide, WORDS_ASM=asm,
             SHIFT=shift, WL8=wl8, BOX=_BOX_LAYOUT, SPLIT=split),
        dict(num_warps=w), (has_bias, bn, w, k, xr, x2.dtype, wide, asm, xs, shift, split),
        make_x)


_LAUNCHES = LaunchCache(_phased_kernel)  # a memo of compiled launches, as Triton's own cache
