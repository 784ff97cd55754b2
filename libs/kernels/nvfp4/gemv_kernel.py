"""NVFP4 weight-only linear for a few tokens in Gluon, on `mma.sync` tensor cores.

The routing table (routing.py) sends it at most 8 tokens on layers of at least 2^22
weights with K a multiple of 128 (gemv_configs.pick_config).

Why a kernel of its own: the Triton kernel uses Hopper's warpgroup MMA, whose A operand
lives in registers that Triton can only reuse after a synchronous wait, so each K step pays
barrier + decode + MMA-chain latency in series. Gluon (Triton's explicit-layout language)
lets every register's owner be chosen, so here:

- each warp owns 16 * R weight rows and runs Ampere-style `mma.sync.m16n8k16` on them: a
  warp-local instruction with no barrier, no shared memory and no wait;
- the weights go from global memory straight into registers (int32 words, so they are
  never split into bytes) and are decoded there with the shared inline-PTX decode
  (gluon_common); four K chunks of weights and scales are in flight per warp, x one chunk
  ahead; the words are loaded evict_first, as they are read once (_load_words), with an
  L2 prefetch size of 128 bytes, a row's next chunk (gluon_common.L2_PREFETCH);
- the e4m3 block scales are converted two at a time (`cvt.rn.f16x2.e4m3x2`);
- for one token (X_SMEM) a program first copies its split's x (at most 16 KB) into shared
  memory by cp.async, issues its first weight loads, waits for x and reads each chunk
  from there: x loaded from global memory one chunk ahead would wait behind the weight
  stream.

Long rows are split in K across programs (SPLIT_K), the last program of a tile summing the
partials from a workspace. For one token on mid-sized layers the split is inside the
program instead (SLICES): each warp takes one K slice of the same 16 rows, and x's slices
ride in the MMA's 8 columns (at M = 1 seven of them would be idle), so warp j's
accumulator column j is its slice's partial sum. One in-program reduction replaces the
workspace round trip and the atomic counter. K that is not whole four-chunk groups per
split (Llama-2's 11008) splits unevenly, the chunks past a split's end loaded as zeros
(RAGGED).

Register layouts (the crux). A thread (lane = 4g + t) of mma.m16n8k16 holds A's rows g and
g + 8 at MMA K indices {2t, 2t+1, 2t+8, 2t+9}, and B's column g at the same K indices. Thread
(g, t) loads BYTES contiguous bytes of each of its rows at byte offset BYTES * t of the
chunk. The decode turns 4 bytes b0..b3 into the pairs (lo b0, hi b0), (lo b1, hi b1), ..
(NATURAL_PRMTS): register j = i1 + 2 i2 holds byte j's two nibbles e, so with the byte's
offset in the chunk c = BYTES*t + 4q + j the real K is 2c + e, and the MMA K index is
    k = 32q + 16 i2 + 8 i1 + 2t + e    (q: word of the thread)
so every decoded pair register IS an A fragment register (k, k+1 differ in e) and nothing
moves between threads: the Gluon reshape/permute below only renames registers, checked at
compile time by `convert_layout(..., assert_trivial=True)`. x is reordered the same way,
and since each of its pairs is two neighbours in memory, that too only renames registers.

Numerics are those of triton_kernel (same decode, fp32 accumulation, s2 in the epilogue).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..split_counters import tile_counters
from .common import DECODE, split_workspace
from .gemv_configs import fits
from .gluon_common import (
    L2_PREFETCH,
    NATURAL_ASM_BF16,
    NATURAL_ASM_F16,
    halves,
    load_s2_bias,
    word_scales,
    words_load_asm,
)
from .grid import cdiv
from .launch_cache import Launch, LaunchCache


def _log2(v: int) -> int:
    assert v > 0 and v & (v - 1) == 0, v
    return v.bit_length() - 1


@functools.cache  # built once per config, not on every linear call
def layouts(bn: int, bm: int, num_warps: int, nbytes: int):
    """(weight words [bn, nbytes] (int32: 4 bytes each), scale pairs [bn, nbytes/16] (int16:
    two blocks' e4m3 bytes), x [bm, 8*nbytes], MMA accumulator) layouts; see the module
    docstring. Thread (g, t) holds rows g, g + 8 (and those + 16 * num_warps * i) of its warp's
    16, and the t-th quarter of each row's chunk."""
    # gemv_configs' tiles: 16 bytes of a row a thread (whole scale pairs), 8 MMA columns
    assert nbytes == 16 and bm == 8, (nbytes, bm)
    w = num_warps
    rows_rep = [[16 * w << i, 0] for i in range(_log2(bn // (16 * w)))]
    warp_rows = [[16 << i, 0] for i in range(_log2(w))]
    g_lanes = [[1, 0], [2, 0], [4, 0]]

    def per_thread(n):  # n consecutive elements per thread and row, 4n per row and chunk
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1 << i] for i in range(_log2(n))] + [[8, 0]] + rows_rep,
            lane_bases=[[0, n], [0, 2 * n]] + g_lanes,
            warp_bases=warp_rows, block_bases=[], shape=[bn, 4 * n])

    xl = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(_log2(2 * nbytes))],
        lane_bases=[[0, 2 * nbytes], [0, 4 * nbytes]] + g_lanes,
        warp_bases=[[0, 0]] * _log2(w), block_bases=[], shape=[bm, 8 * nbytes])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1], instr_shape=[16, 8])
    return per_thread(nbytes // 4), per_thread(nbytes // 16), xl, mma


@gluon.jit
def _mma_step(wd, sp, xt, acc, WL: gl.constexpr, MMA: gl.constexpr):
    """acc += decode(wd, sp) @ xt.T for one K chunk (see the module docstring's layout)."""
    BN: gl.constexpr = wd.shape[0]
    NW: gl.constexpr = wd.shape[1]  # int32 words per row per chunk
    BM: gl.constexpr = xt.shape[0]
    Q: gl.constexpr = NW // 4
    dtype: gl.constexpr = xt.dtype
    if dtype == gl.bfloat16:
        word_asm: gl.constexpr = NATURAL_ASM_BF16
    else:
        word_asm: gl.constexpr = NATURAL_ASM_F16
    scale = word_scales(sp, NW, dtype, WL)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        word_asm, "=r,=r,=r,=r,r,h", [wd, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    # register j = i1 + 2 i2 of word (t, q) holds byte j's nibbles e: [row, t, q, e, i1, i2]
    # -> MMA K index (q, i2, i1, t, e)
    w = gl.join(gl.join(halves(p0, dtype), halves(p1, dtype)),
                gl.join(halves(p2, dtype), halves(p3, dtype)))  # [BN, NW, e, i1, i2]
    w = gl.reshape(w, [BN, 4, Q, 2, 2, 2])
    w = gl.reshape(gl.permute(w, (0, 2, 5, 4, 1, 3)), [BN, 8 * NW])
    w = gl.convert_layout(w, gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2),
                          assert_trivial=True)
    x = gl.reshape(xt, [BM, 4, Q, 2, 2, 2])  # real K in the chunk: 32t + 8q + 4 i2 + 2 i1 + e
    x = gl.reshape(gl.permute(x, (0, 2, 3, 4, 1, 5)), [BM, 8 * NW])
    x = gl.convert_layout(gl.permute(x, (1, 0)),
                          gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2),
                          assert_trivial=True)
    return mma_v2(w, x, acc)


@gluon.jit
def _store_scaled(acc, rows, toks, s2, bias, out_ptr, N, M, stride_om,
                  HAS_BIAS: gl.constexpr, OUT_LOG2: gl.constexpr):
    """out[toks, rows] = acc * 2^OUT_LOG2 * s2 (+ bias), masked to M and N."""
    y = (acc * (2.0**OUT_LOG2)) * s2  # the power of two is exact
    if HAS_BIAS:
        y += bias[:, None]
    ptrs = out_ptr + toks[None, :].to(gl.int64) * stride_om + rows[:, None]
    gl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (toks < M)[None, :])


@gluon.jit
def _store(acc, rows, toks, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
           HAS_BIAS: gl.constexpr, OUT_LOG2: gl.constexpr):
    s2, bias = load_s2_bias(s2_ptr, bias_ptr, rows, N, HAS_BIAS)
    _store_scaled(acc, rows, toks, s2, bias, out_ptr, N, M, stride_om, HAS_BIAS, OUT_LOG2)


@gluon.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_w, stride_s, stride_om,  # w in int32 words, s in int16 pairs
    k_iters,  # K chunks (of 8 * NBYTES elements) per split or slice, a multiple of 4;
    # with RAGGED, the chunks of all K (the splits then differ by up to one chunk)
    tile_rows,  # weight rows a program writes: BN, or fewer without SLICES (see ROWS in
    # pick_config); its BN - tile_rows spare rows re-read its last row and are not stored
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, NBYTES: gl.constexpr,
    SPLIT_K: gl.constexpr, SLICES: gl.constexpr, RAGGED: gl.constexpr,
    OUT_LOG2: gl.constexpr,
    WL: gl.constexpr, SL: gl.constexpr, XL: gl.constexpr, MMA: gl.constexpr,
    X_SMEM: gl.constexpr = False, KCS: gl.constexpr = 4,  # one token: x in shared memory,
    # KCS chunks of it allocated (k_iters rounded up to a power of two)
    WORDS_ASM: gl.constexpr = "",  # the word loads' PTX with an L2 prefetch size (_words_asm)
):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    WS: gl.constexpr = NBYTES  # int32 words per weight row per chunk (4 threads)
    SS: gl.constexpr = NBYTES // 4  # int16 scale pairs per weight row per chunk
    XS: gl.constexpr = 8 * NBYTES  # x elements per chunk
    if RAGGED:
        # K is not whole four-chunk groups per split: split pid_k takes chunks [c, end),
        # rounded up to whole groups whose chunks past `end` load as zeros.
        c = pid_k * k_iters // SPLIT_K
        end = (pid_k + 1) * k_iters // SPLIT_K
        n_iters = (end - c + 3) // 4 * 4
    else:
        c = pid_k * k_iters
        end = c + k_iters
        n_iters = k_iters
    k_start = c * XS  # this split's first K index (slices: 0)
    k_len = k_iters * XS  # K elements per slice
    # Rows past N re-read row N - 1 and tokens past M re-read token M - 1 (neither is
    # stored), so the loop's loads need no masks.
    rows, k0 = _rows_and_k0(pid_n, tile_rows, k_start, k_len, N, BN, SLICES, WL)
    w_ptrs = (w_ptr + rows[:, None].to(gl.int64) * stride_w + (k0 // 8)[:, None]
              + gl.arange(0, WS, layout=gl.SliceLayout(0, WL))[None, :])
    srows, sk0 = _rows_and_k0(pid_n, tile_rows, k_start, k_len, N, BN, SLICES, SL)
    s_ptrs = (s_ptr + srows[:, None].to(gl.int64) * stride_s + (sk0 // 32)[:, None]
              + gl.arange(0, SS, layout=gl.SliceLayout(0, SL))[None, :])
    toks = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
    if SLICES == 1:
        x_ptrs = (x_ptr + gl.minimum(toks, M - 1)[:, None].to(gl.int64) * stride_xm
                  + (k_start + gl.arange(0, XS, layout=gl.SliceLayout(0, XL)))[None, :])
    else:  # the one token's K slices as the MMA's columns
        x_ptrs = (x_ptr + gl.minimum(toks, SLICES - 1)[:, None] * k_len
                  + gl.arange(0, XS, layout=gl.SliceLayout(0, XL))[None, :])

    if X_SMEM:
        x_sm = _stage_x(x_ptr + k_start, k_iters, KCS, XS)
    else:
        x_sm = None
    c0 = c
    # Four weight chunks in flight (w0..w3 with their scales), x one chunk ahead (from
    # shared memory with X_SMEM, else from L1: every program with this split reads the same
    # x). c is the first chunk of the group being multiplied, n of the group being loaded.
    acc = gl.zeros([BN, BM], gl.float32, MMA)
    w0 = _load_words(w_ptrs, c, end, RAGGED, WORDS_ASM)
    sc0 = _load(s_ptrs, c, end, RAGGED)
    w1 = _load_words(w_ptrs + WS, c + 1, end, RAGGED, WORDS_ASM)
    sc1 = _load(s_ptrs + SS, c + 1, end, RAGGED)
    w2 = _load_words(w_ptrs + 2 * WS, c + 2, end, RAGGED, WORDS_ASM)
    sc2 = _load(s_ptrs + 2 * SS, c + 2, end, RAGGED)
    w3 = _load_words(w_ptrs + 3 * WS, c + 3, end, RAGGED, WORDS_ASM)
    sc3 = _load(s_ptrs + 3 * SS, c + 3, end, RAGGED)
    if X_SMEM:
        _wait_x()
    xa = _x_chunk(x_ptrs, x_sm, c, c0, end, RAGGED, XL)
    for _ in range(n_iters // 4 - 1):
        n = c + 4
        w_ptrs += 4 * WS
        s_ptrs += 4 * SS
        xb = _x_chunk(x_ptrs + XS, x_sm, c + 1, c0, end, RAGGED, XL)
        acc = _mma_step(w0, sc0, xa, acc, WL, MMA)
        w0 = _load_words(w_ptrs, n, end, RAGGED, WORDS_ASM)
        sc0 = _load(s_ptrs, n, end, RAGGED)
        xa = _x_chunk(x_ptrs + 2 * XS, x_sm, c + 2, c0, end, RAGGED, XL)
        acc = _mma_step(w1, sc1, xb, acc, WL, MMA)
        w1 = _load_words(w_ptrs + WS, n + 1, end, RAGGED, WORDS_ASM)
        sc1 = _load(s_ptrs + SS, n + 1, end, RAGGED)
        xb = _x_chunk(x_ptrs + 3 * XS, x_sm, c + 3, c0, end, RAGGED, XL)
        acc = _mma_step(w2, sc2, xa, acc, WL, MMA)
        w2 = _load_words(w_ptrs + 2 * WS, n + 2, end, RAGGED, WORDS_ASM)
        sc2 = _load(s_ptrs + 2 * SS, n + 2, end, RAGGED)
        x_ptrs += 4 * XS
        xa = _x_chunk(x_ptrs, x_sm, n, c0, end, RAGGED, XL)
        acc = _mma_step(w3, sc3, xb, acc, WL, MMA)
        w3 = _load_words(w_ptrs + 3 * WS, n + 3, end, RAGGED, WORDS_ASM)
        sc3 = _load(s_ptrs + 3 * SS, n + 3, end, RAGGED)
        c = n
    xb = _x_chunk(x_ptrs + XS, x_sm, c + 1, c0, end, RAGGED, XL)
    acc = _mma_step(w0, sc0, xa, acc, WL, MMA)
    xa = _x_chunk(x_ptrs + 2 * XS, x_sm, c + 2, c0, end, RAGGED, XL)
    acc = _mma_step(w1, sc1, xb, acc, WL, MMA)
    xb = _x_chunk(x_ptrs + 3 * XS, x_sm, c + 3, c0, end, RAGGED, XL)
    acc = _mma_step(w2, sc2, xa, acc, WL, MMA)
    acc = _mma_step(w3, sc3, xb, acc, WL, MMA)

    if SLICES == 1:
        _finish(acc, pid_n, pid_k, tile_rows, s2_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
                N, M, stride_om, HAS_BIAS, BN, BM, SPLIT_K, OUT_LOG2, MMA)
    else:
        _finish_slices(acc, pid_n, s2_ptr, bias_ptr, out_ptr, N, HAS_BIAS, BN, SLICES,
                       OUT_LOG2, MMA)


@gluon.jit
def _stage_x(x_ptr, k_iters, KCS: gl.constexpr, XS: gl.constexpr):
    """One token's x over k_iters chunks of XS (a multiple of 4) from x_ptr into shared
    memory [KCS, XS] by cp.async: every copy in flight at once, no registers held. The
    caller issues the weights' first loads next and waits (_wait_x) only before x's first
    use. Why shared memory: x read from global memory one chunk ahead waits behind the
    weight stream, where the whole of x for a split is at most 16 KB. Why cp.async: x
    staged through registers, each batch stored before the weights' first loads are
    issued, makes the start a latency or two longer."""
    NW: gl.constexpr = gl.num_warps()
    # 16-byte copies where x fills them (KCS * XS is at least 512 elements); cp.async
    # copies 4 bytes at the least, two of x's 16-bit elements: 8 warps at most at KCS 4
    VEC: gl.constexpr = 8 if KCS * XS >= 8 * 32 * NW else KCS * XS // (32 * NW)
    gl.static_assert(VEC >= 2, "too many warps to stage so few chunks of x")
    BLK: gl.constexpr = VEC * 32 * NW
    flat = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [KCS * XS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    offs = gl.arange(0, BLK, layout=gl.BlockedLayout([VEC], [32], [NW], [0]))
    for b in gl.static_range(KCS * XS // BLK):
        async_copy.async_copy_global_to_shared(flat.slice(b * BLK, BLK), x_ptr + b * BLK + offs,
                                               mask=b * BLK + offs < k_iters * XS)
    async_copy.commit_group()
    return flat._reinterpret(x_ptr.dtype.element_ty, [KCS, XS],
                             gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _wait_x():
    """Wait for _stage_x's copies. The first barrier keeps the weights' loads issued before
    it ahead of the wait (without it they compile after the wait); the second makes
    every thread's copies visible to all."""
    gl.thread_barrier()
    async_copy.wait_group(0)
    gl.thread_barrier()


@gluon.jit
def _x_chunk(ptrs, x_sm, chunk, c0, end, RAGGED: gl.constexpr, XL: gl.constexpr):
    """x [BM, XS] of one chunk: from global memory, or (x_sm given: one token) row
    chunk - c0 of x_sm (c0: the split's first chunk), the same row in every MMA column."""
    if x_sm is None:
        return _load(ptrs, chunk, end, RAGGED)
    else:
        x1 = x_sm.index(chunk - c0).load(gl.SliceLayout(0, XL))
        zeros = gl.zeros([ptrs.shape[0], x1.shape[0]], x1.dtype, XL)
        return gl.broadcast(gl.expand_dims(x1, 0), zeros)[0]


@gluon.jit
def _load_words(ptrs, chunk, end, RAGGED: gl.constexpr, WORDS_ASM: gl.constexpr = ""):
    """_load for the weight words, marked evict_first: each word is read once, so it should
    not push out of the caches what is read again (the scale sectors, four chunks' loads
    each; x; the split-K partials). The scales marked so too would be slower.

    WORDS_ASM (_words_asm, from the launch's L2 prefetch size) loads them with an L2
    prefetch size instead."""
    if RAGGED or WORDS_ASM == "":
        return _load(ptrs, chunk, end, RAGGED, "evict_first")
    else:
        return gl.inline_asm_elementwise(WORDS_ASM, "=r,=r,=r,=r,l,l,l,l", [ptrs],
                                         dtype=gl.int32, is_pure=False, pack=4)


def _words_asm(pf: int) -> str:
    """words_load_asm for the GEMV's 16 bytes a thread, evict_first in L1."""
    return words_load_asm(pf, 4, ".L1::evict_first")


_NO_HINT = gl.constexpr("")  # gl.load's default eviction policy


@gluon.jit
def _load(ptrs, chunk, end, RAGGED: gl.constexpr, EVICT: gl.constexpr = _NO_HINT):
    """One chunk's loads; with RAGGED, zeros for a chunk past the split's end (zero words,
    scales and x: it adds nothing). EVICT: the loads' eviction policy ("": the default)."""
    if RAGGED:
        return gl.load(ptrs, mask=chunk < end, other=0, eviction_policy=EVICT)
    else:
        return gl.load(ptrs, eviction_policy=EVICT)


@gluon.jit
def _rows_and_k0(pid_n, tile_rows, k_start, k_len, N, BN: gl.constexpr,
                 SLICES: gl.constexpr, L: gl.constexpr):
    """For each of the tile's BN rows (layout L): the weight row it reads and its first K
    index. Without slices, rows pid_n * tile_rows + i from k_start (the split's), the
    spare rows i >= tile_rows re-reading the tile's last (the same addresses as a
    neighbouring lane's, so no extra DRAM bytes). With SLICES, row i is weight row
    16 (i // (16 SLICES)) + i % 16 of the program's BN / SLICES and reads K slice
    (i // 16) % SLICES: each warp's 16 rows are one slice."""
    i = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    if SLICES == 1:
        row = pid_n * tile_rows + gl.minimum(i, tile_rows - 1)
        return gl.minimum(row, N - 1), i * 0 + k_start
    else:
        row = pid_n * (BN // SLICES) + (i // (16 * SLICES)) * 16 + i % 16
        return gl.minimum(row, N - 1), ((i // 16) % SLICES) * k_len


@gluon.jit
def _finish_slices(acc, pid_n, s2_ptr, bias_ptr, out_ptr, N, HAS_BIAS: gl.constexpr,
                   BN: gl.constexpr, SLICES: gl.constexpr, OUT_LOG2: gl.constexpr,
                   L: gl.constexpr):
    """Sum each weight row's slices and write the one output token. Row i of the tile
    (slice (i // 16) % SLICES) holds its partial sum in MMA column (its slice): the other
    columns multiplied the other slices' x and are dropped."""
    NWARPS: gl.constexpr = gl.num_warps()
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [NWARPS], [0])
    # s2 and bias first, so their L2 round trip overlaps the reduction's barriers rather
    # than waiting before the store (loaded before the K loop they would cost the loop two
    # spills)
    rows = pid_n * (BN // SLICES) + gl.arange(0, BN // SLICES, layout=flat)
    s2, bias = load_s2_bias(s2_ptr, bias_ptr, rows, N, HAS_BIAS)
    i = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    col = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, L))
    part = gl.sum(gl.where(((i // 16) % SLICES)[:, None] == col[None, :], acc, 0.0), axis=1)
    part = gl.reshape(gl.convert_layout(part, flat), [BN // (16 * SLICES), SLICES, 16])
    total = gl.convert_layout(gl.reshape(gl.sum(part, axis=1), [BN // SLICES]), flat)
    y = total * (2.0**OUT_LOG2) * s2  # as _store_scaled, for one token
    if HAS_BIAS:
        y += bias
    gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


@gluon.jit
def _finish(acc, pid_n, pid_k, tile_rows, s2_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, N, M,
            stride_om, HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
            SPLIT_K: gl.constexpr, OUT_LOG2: gl.constexpr, L: gl.constexpr):
    """Write this program's [tile_rows, BM] sums (layout L; the spare rows past tile_rows
    are dropped), or (split K) add them to the other splits' first."""
    i = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    out_rows = gl.where(i < tile_rows, pid_n * tile_rows + i, N)  # row N: masked out
    out_toks = gl.arange(0, BM, layout=gl.SliceLayout(0, L))
    if SPLIT_K == 1:
        _store(acc, out_rows, out_toks, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
               HAS_BIAS, OUT_LOG2)
    else:
        # As in triton_kernel: publish the partial; the last of the tile's programs to
        # arrive sums all partials in split order (deterministic) and writes the output.
        tile = pid_n
        n_tiles = gl.num_programs(0)
        offs = (gl.arange(0, BN, layout=gl.SliceLayout(1, L))[:, None] * BM
                + out_toks[None, :])
        gl.store(ws_ptr + (pid_k * n_tiles + tile).to(gl.int64) * (BN * BM) + offs, acc)
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BN, BM], gl.float32, L)
            for s in range(SPLIT_K):
                part = ws_ptr + (s * n_tiles + tile).to(gl.int64) * (BN * BM) + offs
                total += gl.load(part, cache_modifier=".cg")  # L2: written by other SMs
            _store(total, out_rows, out_toks, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
                   HAS_BIAS, OUT_LOG2)
            # ready for the next launch, which kernel order already sequences after this
            # one: relaxed, so no fence waits for the output's stores first
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BN, BM, NBYTES, SPLIT_K,
    num_warps, optional SLICES, RAGGED, X_SMEM, ROWS): gemv_configs.pick_config's; requires
    fits(M, K, cfg) and unit
    strides along K."""
    _LAUNCHES(*_call(x2, packed, scales, s2, bias, out, cfg, shared_ws=False))
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment. Its split-K workspace and counters are the current stream's, so the
    caller keeps one Launch a stream."""
    return _LAUNCHES.bind(*_call(x2, packed, scales, s2, bias, out, cfg, shared_ws=True),
                          x2, out)


def _call(x2, packed, scales, s2, bias, out, cfg, shared_ws: bool) -> tuple:
    """(grid, runtime args, constexprs, options, static key) of one launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, nbytes, split, w = (cfg[key] for key in ("BN", "BM", "NBYTES", "SPLIT_K",
                                                     "num_warps"))
    slices = cfg.get("SLICES", 1)
    rows = cfg.get("ROWS", bn)  # weight rows a program writes
    assert fits(m, k, cfg), (m, k, cfg)
    assert slices == 1 or (split == 1 and bn % (16 * slices) == 0 and slices in (2, 4, 8)
                           and slices == w and rows == bn), cfg
    assert 0 < rows <= bn, cfg
    ragged = cfg.get("RAGGED", False)
    pf = 0 if ragged else L2_PREFETCH  # masked (RAGGED) loads take no hint
    # chunks per split or slice, a multiple of 4 (fits()); RAGGED: chunks of all K
    k_iters = k // (8 * nbytes) if ragged else k // (8 * nbytes * split * slices)
    x_smem = cfg.get("X_SMEM", False)
    kcs = 1 << (k_iters - 1).bit_length() if x_smem else 4  # x's chunks, a power of two
    grid = (cdiv(n, rows // slices), split)
    if split > 1:
        ws = split_workspace(x2.device, split * grid[0] * bn * bm, shared_ws)
        cnt = tile_counters(x2.device, grid[0])
    else:
        ws = cnt = out  # never read
    wl, sl, xl, mma = layouts(bn, bm, w, nbytes)
    words = packed.view(torch.int32)
    pairs = scales.view(torch.int16)
    has_bias = bias is not None
    return (
        grid,
        (x2, words, pairs, s2, bias if has_bias else out, out, ws, cnt,
         m, n, x2.stride(0), words.stride(0), pairs.stride(0), out.stride(0), k_iters,
         rows),
        dict(HAS_BIAS=has_bias, BN=bn, BM=bm, NBYTES=nbytes, SPLIT_K=split, SLICES=slices,
             RAGGED=ragged, OUT_LOG2=DECODE[x2.dtype][1], WL=wl, SL=sl, XL=xl, MMA=mma,
             X_SMEM=x_smem, KCS=kcs, WORDS_ASM=_words_asm(pf)),
        dict(num_warps=w), (has_bias, bn, bm, nbytes, split, slices, ragged, w,
                            x2.dtype, pf, x_smem, kcs))


_LAUNCHES = LaunchCache(_gemv_kernel)  # a memo of compiled launches, as Triton's own cache

