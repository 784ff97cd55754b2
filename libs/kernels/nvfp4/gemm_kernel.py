"""NVFP4 weight-only linear for many tokens in Gluon: decode warps feed Hopper's wgmma.

At a few hundred tokens the linear is tensor-core work, and linear_kernels' Triton kernel
runs at about half of torch's bf16 matmul there: it decodes each weight tile into the
registers of the very warps that then wait for their wgmma, so decode and MMA take turns.
Here they run side by side in different warps of one program (Gluon's warp_specialize),
12 warps in all:

- an x loader warp brings x tiles [BM tokens, BK] into the tile ring by TMA;
- a weight loader warp brings each step's packed words [BN, BK / 8] (int32) into a weight
  ring, and every G steps their block scales [BN, G * BK / 32] (int16 pairs: a TMA box
  needs 16-byte rows) into a scale ring, by TMA;
- DECODERS decode partitions of BN / 32 warps (one weight row per thread) take turns on
  the steps: decode with the inline-PTX decode of the other kernels, store the bf16/fp16
  tile [BN rows, BK] into the tile ring, swizzled the way wgmma reads it;
- one MMA warpgroup waits for both tiles of a step, issues an asynchronous wgmma (weights
  as the left operand, the x tile transposed in place as the right one: "swap AB", so the
  accumulator is [BN rows, BM tokens]) and frees the slot of the step before;
- the epilogue leaves by TMA through a (by then free) x slot; split K, where the tiles
  alone would leave SMs idle, sums the partials in a fixed order (deterministic).

Every ring slot has a `ready` and an `empty` mbarrier. Ordering between proxies: the MMA
side fences (generic -> async proxy) after seeing a tile ready; the weight loader fences
before a TMA overwrites a slot the decoders read.

The decoders hand the weights over in natural K order (`_PAIR_ASM`: each packed register
holds one byte's two weights), so a decoded row is stored as plain 16-byte pieces.

Measured on an H200 (docs/notes/nvfp4-triton.md, session `gluon-gemm`), 8192 x 28672 at
M = 256: ~172 us against ~172 us for torch's bf16 matmul and ~320 us for the Triton kernel.
The MMA side alone (decode replaced by zero tiles) runs in 136 us and the decoders alone in
~77 us; together they stay at ~172 us: ncu shows the tensor pipe at 82% and L1/shared
throughput at 87% of their peaks, shared memory carrying the x tiles (TMA writes, wgmma
reads) and the decoded tiles.

Numerics equal linear_kernels' (same exact decoded weights, fp32 accumulation, s2 and the
power of two in the epilogue).
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

from .gemv_kernel import _halves, _word_scales
from .linear_kernels import _DECODE, _tile_counters

# PTX: one int32 word of bytes b0..b3 and its block scale (16-bit, pre-multiplied, in both
# halves of $5) -> the weight pairs (lo b0, hi b0), (lo b1, hi b1), ... : K order. The same
# shift, mask and multiply as linear_kernels' decode; only prmt's byte choice differs: the
# low half takes byte j of w << 4 (b_j's low nibble in its top bits), the high half byte j
# of w itself (b_j's high nibble there), and each upper byte a copy of that byte's bit 7.
_PAIR_ASM = """
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
_PAIR_ASM_BF16 = gl.constexpr(_PAIR_ASM.format(sh=2, mask="0x81C081C0", ty="bf16"))
_PAIR_ASM_F16 = gl.constexpr(_PAIR_ASM.format(sh=5, mask="0x8E008E00", ty="f16"))


@gluon.jit
def _decode_tile(words, pairs, dtype: gl.constexpr, WL: gl.constexpr):
    """int32 words [BN, NW] (8 weights each) and int16 scale pairs [BN, NW / 4] (two
    blocks' e4m3 bytes) -> the decoded weights [BN, 8 * NW] in dtype, K in order."""
    BN: gl.constexpr = words.shape[0]
    NW: gl.constexpr = words.shape[1]
    if dtype == gl.bfloat16:
        pair_asm: gl.constexpr = _PAIR_ASM_BF16
    else:
        pair_asm: gl.constexpr = _PAIR_ASM_F16
    scale = _word_scales(pairs, NW, dtype, WL)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        pair_asm, "=r,=r,=r,=r,r,h", [words, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    w = gl.join(gl.join(_halves(p0, dtype), _halves(p1, dtype)),
                gl.join(_halves(p2, dtype), _halves(p3, dtype)))  # [BN, NW, e, j % 2, j // 2]
    return gl.reshape(gl.permute(w, (0, 1, 4, 3, 2)), [BN, 8 * NW])


@gluon.jit
def _decode_partition(w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs, ready, empty,
                      k_steps, first, every):
    """Decode warps for steps first, first + every, ...: one weight row per thread; take
    the step's words from the weight ring and its scales from the scale ring (TMA-filled;
    a scale slot holds SG steps), decode, wait for the tile slot to be free, store, arrive.
    (No proxy fence here: see _mma_partition.)"""
    S: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    WS: gl.constexpr = w_ring.shape[0]
    SS: gl.constexpr = s_ring.shape[0]
    NW: gl.constexpr = BK // 8  # int32 words per row and step
    NP: gl.constexpr = BK // 32  # int16 scale pairs per row and step
    SG: gl.constexpr = s_ring.shape[2] // NP  # steps per scale slot
    WL: gl.constexpr = gl.BlockedLayout([1, NW], [32, 1], [gl.num_warps(), 1], [1, 0])
    SL: gl.constexpr = gl.BlockedLayout([1, NP], [32, 1], [gl.num_warps(), 1], [1, 0])
    SGL: gl.constexpr = gl.BlockedLayout([1, SG, NP], [32, 1, 1], [gl.num_warps(), 1, 1],
                                         [2, 1, 0])
    sel = gl.arange(0, SG, layout=gl.SliceLayout(0, gl.SliceLayout(2, SGL)))[None, :, None]
    for i in range(first, k_steps, every):
        g = i // SG
        sslot = g % SS
        mbarrier.wait(s_ready.index(sslot), (g // SS) & 1)
        group = gl.reshape(s_ring.index(sslot).load(gl.BlockedLayout(
            [1, SG * NP], [32, 1], [gl.num_warps(), 1], [1, 0])), [BN, SG, NP])
        group = gl.convert_layout(group, SGL, assert_trivial=True)
        pairs = gl.sum(gl.where(sel == i % SG, group, 0), axis=1).to(gl.int16)
        pairs = gl.convert_layout(pairs, SL, assert_trivial=True)
        # This partition's last step in the scale slot: it can be refilled.
        mbarrier.arrive(s_empty.index(sslot), count=1,
                        pred=(i % SG + every >= SG) | (i + every >= k_steps))
        wslot = i % WS
        mbarrier.wait(w_ready.index(wslot), (i // WS) & 1)
        words = w_ring.index(wslot).load(WL)
        mbarrier.arrive(w_empty.index(wslot), count=1)
        a = _decode_tile(words, pairs, a_bufs.dtype, WL)
        slot = i % S
        mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
        a_bufs.index(slot).store(a)
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _weight_load_partition(w_desc, s_desc, w_ring, s_ring, w_ready, w_empty, s_ready, s_empty,
                           off_n, k_first, k_steps):
    """Weight loader warp: each step's packed words into the weight ring, and every SG
    steps their block scales into the scale ring, by TMA (rows past N arrive as zeros and
    are never stored)."""
    WS: gl.constexpr = w_ring.shape[0]
    SS: gl.constexpr = s_ring.shape[0]
    NW: gl.constexpr = w_ring.shape[2]
    GP: gl.constexpr = s_ring.shape[2]  # scale pairs per row and scale slot
    SG: gl.constexpr = GP // (NW // 4)  # steps per scale slot
    for i in range(k_steps):
        if i % SG == 0:
            g = i // SG
            sslot = g % SS
            mbarrier.wait(s_empty.index(sslot), ((g // SS) & 1) ^ 1)
            fence_async_shared()  # the decoders' generic reads before the TMA overwrite
            mbarrier.expect(s_ready.index(sslot), s_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(s_desc, [off_n, k_first // SG * GP + g * GP],
                                            s_ready.index(sslot),
                                            s_ring.index(sslot))
        wslot = i % WS
        mbarrier.wait(w_empty.index(wslot), ((i // WS) & 1) ^ 1)
        fence_async_shared()  # the decoders' generic reads before the TMA overwrite
        mbarrier.expect(w_ready.index(wslot), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, (k_first + i) * NW], w_ready.index(wslot),
                                        w_ring.index(wslot))


@gluon.jit
def _x_load_partition(x_desc, x_bufs, ready, empty, off_m, k_first, k_steps):
    """x loader warp: x tiles into the tile ring by TMA (rows past M arrive as zeros)."""
    S: gl.constexpr = x_bufs.shape[0]
    BK: gl.constexpr = x_bufs.shape[2]
    for i in range(k_steps):
        slot = i % S
        mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, (k_first + i) * BK], ready.index(slot),
                                        x_bufs.index(slot))


@gluon.jit
def _mma_partition(a_bufs, x_bufs, ready, empty, k_steps, ACC: gl.constexpr):
    """MMA warpgroup: one asynchronous wgmma per step, at most one left in flight; the
    slot of the step before is free once that one is done."""
    S: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = a_bufs.shape[1]
    BM: gl.constexpr = x_bufs.shape[1]
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for i in range(k_steps):
        slot = i % S
        mbarrier.wait(ready.index(slot), (i // S) & 1)
        # The decoders' generic-proxy stores, ordered before this by the barrier, made
        # visible to wgmma's async proxy here: a fence in the decode warps would also wait
        # for their own outstanding loads (it compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC).
        fence_async_shared()
        acc = warpgroup_mma(a_bufs.index(slot), x_bufs.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
    return (warpgroup_mma_wait(0, deps=(acc,)),)  # (warp_specialize flattens a tuple)


@gluon.jit
def _epilogue(acc, c_smem, out_desc, s2_ptr, bias_ptr, N, off_n, off_m, HAS_BIAS: gl.constexpr,
              OUT_LOG2: gl.constexpr, ACC: gl.constexpr):
    """acc [BN rows, BM tokens] -> out[off_m:, off_n:] by TMA through c_smem, an x slot
    (all are free by now, and BN == BK gives it the output tile's shape and swizzle):
    whole 128-byte rows instead of scattered 2-byte stores; TMA drops rows and columns
    past M and N."""
    BN: gl.constexpr = acc.shape[0]
    y = (acc * (2.0**OUT_LOG2)) * gl.load(s2_ptr)  # the power of two is exact
    if HAS_BIAS:
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        y += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    c_smem.store(gl.permute(y.to(c_smem.dtype), (1, 0)))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def _gemm_kernel(
    x_desc, w_desc, s_desc, out_desc, s2_ptr, bias_ptr, ws_ptr, cnt_ptr, N,
    k_steps,  # BK steps per split: K // (BK * SPLIT_K)
    HAS_BIAS: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, W_STAGES: gl.constexpr,
    S_STAGES: gl.constexpr,
    OUT_LOG2: gl.constexpr, DECODERS: gl.constexpr, DECODE_REGS: gl.constexpr,
    SPLIT_K: gl.constexpr, ACC: gl.constexpr, A_SMEM: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BN == BK)  # the epilogue reuses an x slot for the output tile
    gl.static_assert(BN // 32 * DECODERS <= 6)  # 12 warps in all (see launch)
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    k_first = gl.program_id(2) * k_steps
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BN, BK], A_SMEM)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.int32, [W_STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.int16, [S_STAGES] + s_desc.block_type.shape,
                                       s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [S_STAGES, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [S_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=2)  # the decoders' arrive + the TMA's expect
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)  # the one decoder of the step
    for s in gl.static_range(S_STAGES):
        mbarrier.init(s_ready.index(s), count=1)
        mbarrier.init(s_empty.index(s), count=DECODERS)  # each has a step in every slot
    fence_async_shared()
    # Several decode partitions take turns (steps d, d + DECODERS, ...): a few warps
    # cannot hide the decode's latencies. (The partition list must be literal: a Gluon
    # kernel cannot build a list of functions, hence one branch per count.)
    if DECODERS == 1:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_x_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_first, k_steps)),
            (_weight_load_partition, (w_desc, s_desc, w_ring, s_ring, w_ready, w_empty,
                                      s_ready, s_empty, off_n, k_first, k_steps)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 0, 1)),
        ], [1, 1, BN // 32], [24, 24, DECODE_REGS])
    elif DECODERS == 2:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_x_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_first, k_steps)),
            (_weight_load_partition, (w_desc, s_desc, w_ring, s_ring, w_ready, w_empty,
                                      s_ready, s_empty, off_n, k_first, k_steps)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 0, 2)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 1, 2)),
        ], [1, 1, BN // 32, BN // 32], [24, 24, DECODE_REGS, DECODE_REGS])
    else:
        gl.static_assert(DECODERS == 3)
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_x_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_first, k_steps)),
            (_weight_load_partition, (w_desc, s_desc, w_ring, s_ring, w_ready, w_empty,
                                      s_ready, s_empty, off_n, k_first, k_steps)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 0, 3)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 1, 3)),
            (_decode_partition, (w_ring, s_ring, w_ready, w_empty, s_ready, s_empty, a_bufs,
                                 ready, empty, k_steps, 2, 3)),
        ], [1, 1, BN // 32, BN // 32, BN // 32],
            [24, 24, DECODE_REGS, DECODE_REGS, DECODE_REGS])
    if SPLIT_K == 1:
        _epilogue(acc, x_bufs.index(0), out_desc, s2_ptr, bias_ptr, N, off_n, off_m,
                  HAS_BIAS, OUT_LOG2, ACC)
    else:
        # Publish this split's partial; the last of the tile's programs to arrive sums
        # all partials in split order (deterministic) and stores (as in gemv_kernel).
        tile = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        n_tiles = gl.num_programs(0) * gl.num_programs(1)
        offs = (gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))[:, None] * BM
                + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))[None, :])
        gl.store(ws_ptr + (gl.program_id(2) * n_tiles + tile) * (BN * BM) + offs, acc)
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BN, BM], gl.float32, ACC)
            for sp in range(SPLIT_K):
                total += gl.load(ws_ptr + (sp * n_tiles + tile) * (BN * BM) + offs,
                                 cache_modifier=".cg")  # L2: written by other SMs
            _epilogue(total, x_bufs.index(0), out_desc, s2_ptr, bias_ptr, N, off_n, off_m,
                      HAS_BIAS, OUT_LOG2, ACC)
            gl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch


@functools.cache  # built once per config, not on every linear call
def layouts(bm: int, bk: int):
    """(the accumulator of the one MMA warpgroup, the decoded tile's shared layout)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, min(bm, 256), 16])
    a_smem = gl.NVMMASharedLayout(swizzle_byte_width=2 * bk if bk <= 64 else 128,
                                  element_bitwidth=16, rank=2)
    return acc, a_smem


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where linear_kernels' Triton
    kernel runs instead: fewer than 96 tokens (there the weight stream, not the tensor
    cores, is the cost; on 8192 x 28672 at M = 65 this kernel took 214 us against 168 us),
    layers under 2^24 weights (not measured), N not a multiple of 8 (TMA rows of the
    output), K not a multiple of 256. 64-row tiles with 128 or 256 tokens: one wgmma
    warpgroup per SM and each weight decoded once per token tile; three decode partitions
    (173 us against 184 us with two and 203 us with one on 8192 x 28672, M = 256); K split
    in two or more while the tiles alone would leave half the SMs idle. From sweeps on an
    H200 (docs/notes/nvfp4-triton.md, session `gluon-gemm`): faster than the Triton kernel
    at M = 96, 128, 192 and 256 on 8192 x 28672 and 4096 x 4096."""
    if m < 96 or n * k < 2**24 or n % 8:
        return None
    cfg = dict(BN=64, BM=128 if m <= 128 else 256, BK=64, G=4, STAGES=4, W_STAGES=8,
               S_STAGES=2, decoders=3, decode_regs=88, SPLIT_K=1)
    if not fits(m, k, cfg):
        return None
    tiles = triton.cdiv(n, cfg["BN"]) * triton.cdiv(m, cfg["BM"])
    while tiles * cfg["SPLIT_K"] * 2 <= sms and fits(m, k, dict(cfg, SPLIT_K=cfg["SPLIT_K"] * 2)):
        cfg["SPLIT_K"] *= 2
    return cfg


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether each K split is whole scale slots (G steps of BK)."""
    return k % (cfg["G"] * cfg["BK"] * cfg.get("SPLIT_K", 1)) == 0


def viewable(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor) -> bool:
    """Whether x, the packed weights, their scales and out make TMA descriptors: 16-byte
    aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.stride(-1) == 1 for t in (x2, packed, scales, out))


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias) with cfg = dict(BN, BM, BK, G, STAGES,
    W_STAGES, S_STAGES, decoders, decode_regs); requires fits() and viewable()."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk, g = (cfg[key] for key in ("BN", "BM", "BK", "G"))
    assert fits(m, k, cfg) and bn == bk, (m, k, cfg)
    acc, a_smem = layouts(bm, bk)
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=a_smem.swizzle_byte_width,
                                    element_bitwidth=16, rank=2)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], x_layout)
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn], x_layout)
    # Weight slots: a step's [BN, BK / 8] int32 words, 32-byte swizzled so that the decode
    # threads (one 32-byte row each) read 16-byte pieces without bank conflicts; scale
    # slots: G steps' [BN, G * BK / 32] int16 pairs (TMA boxes need 16-byte rows).
    words = packed.view(torch.int32)
    pairs = scales.view(torch.int16)
    w_desc = TensorDescriptor.from_tensor(words, [bn, bk // 8], gl.NVMMASharedLayout(
        swizzle_byte_width=32, element_bitwidth=32, rank=2))
    s_desc = TensorDescriptor.from_tensor(pairs, [bn, g * bk // 32], gl.NVMMASharedLayout(
        swizzle_byte_width=0, element_bitwidth=16, rank=2))
    split = cfg.get("SPLIT_K", 1)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    if split > 1:
        tiles = grid[0] * grid[1]
        ws = torch.empty(split * tiles * bn * bm, dtype=torch.float32, device=x2.device)
        cnt = _tile_counters(x2.device, tiles)
    else:
        ws = cnt = s2  # never read
    _gemm_kernel[grid](
        x_desc, w_desc, s_desc, out_desc, s2, bias if bias is not None else out, ws, cnt, n,
        k // (bk * split),
        HAS_BIAS=bias is not None, BK=bk, STAGES=cfg["STAGES"], W_STAGES=cfg["W_STAGES"],
        S_STAGES=cfg["S_STAGES"],
        OUT_LOG2=_DECODE[x2.dtype][1], DECODERS=cfg["decoders"],
        DECODE_REGS=cfg["decode_regs"], SPLIT_K=split, ACC=acc, A_SMEM=a_smem,
        num_warps=4, maxnreg=168,  # 12 warps (3 warpgroups) at 168 registers: 64.5K
    )
    return out
