"""NVFP4 weight-only linear for many tokens in Gluon: decode warps feed Hopper's wgmma.

At a few hundred tokens the linear is tensor-core work, and linear_kernels' Triton kernel
runs at about half of torch's bf16 matmul there: it decodes each weight tile into the
registers of the very warps that then wait for their wgmma, so decode and MMA take turns.
Here they run side by side in different warps of one program (Gluon's warp_specialize):

- a loader warp brings x tiles [BM tokens, BK] into a shared-memory ring with TMA;
- four decode warps read the packed weights and block scales straight from global memory
  (a few steps ahead, in registers), decode them with the inline-PTX decode of the other
  kernels, and store the bf16/fp16 tile [BN rows, BK] into a second ring, swizzled the way
  wgmma reads it;
- the MMA warpgroup(s) wait for both tiles of a step, issue an asynchronous wgmma
  (weights as the left operand, the x tile transposed in place as the right one: "swap
  AB", so the output tile is [BN rows, BM tokens]) and free the step before last.

One `ready` mbarrier per ring slot completes when the decoders have arrived and the TMA
bytes have landed; one `empty` barrier per slot is arrived by the MMA side when the wgmma
reading the slot has finished. The decoders hand the weights over in natural K order
(`_PAIR_ASM`: each packed register holds one byte's two weights), so a decoded row is
stored as plain 16-byte pieces.

Numerics equal linear_kernels' (same exact decoded weights, fp32 accumulation, s2 and the
power of two in the epilogue).
"""

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gemv_kernel import _SCALE_ASM_BF16, _SCALE_ASM_F16, _halves
from .linear_kernels import _DECODE

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
        scale_asm: gl.constexpr = _SCALE_ASM_BF16
        pair_asm: gl.constexpr = _PAIR_ASM_BF16
    else:
        scale_asm: gl.constexpr = _SCALE_ASM_F16
        pair_asm: gl.constexpr = _PAIR_ASM_F16
    sp = gl.inline_asm_elementwise(scale_asm, "=r,h", [pairs], dtype=gl.int32, is_pure=True,
                                   pack=1)
    scale = gl.reshape(_halves(sp, dtype), [BN, NW // 2])  # per 16-weight block
    scale = gl.reshape(gl.join(scale, scale), [BN, NW])  # per word
    scale = gl.convert_layout(scale, WL, assert_trivial=True)
    p0, p1, p2, p3 = gl.inline_asm_elementwise(
        pair_asm, "=r,=r,=r,=r,r,h", [words, scale],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    w = gl.join(gl.join(_halves(p0, dtype), _halves(p1, dtype)),
                gl.join(_halves(p2, dtype), _halves(p3, dtype)))  # [BN, NW, e, j % 2, j // 2]
    return gl.reshape(gl.permute(w, (0, 1, 4, 3, 2)), [BN, 8 * NW])


@gluon.jit
def _decode_partition(w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                      stride_s, k_steps, first, every, P: gl.constexpr):
    """Decode warps for steps first, first + every, ...: each thread copies its weight row's
    words and scales of the step P - 1 ahead into its own ring slot (cp.async: many bytes
    in flight without holding registers), decodes the oldest one, waits for the tile slot
    to be free, stores, arrives. (No proxy fence here: see _mma_partition.)"""
    S: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    NW: gl.constexpr = BK // 8  # int32 words per row and step
    NP: gl.constexpr = BK // 32  # int16 scale pairs per row and step
    WL: gl.constexpr = gl.BlockedLayout([1, NW], [32, 1], [gl.num_warps(), 1], [1, 0])
    SL: gl.constexpr = gl.BlockedLayout([1, NP], [32, 1], [gl.num_warps(), 1], [1, 0])
    base = first * P  # this partition's P ring slots
    # Rows past N re-read row N - 1 (never stored), so the loads need no masks.
    rows = gl.minimum(off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, WL)), N - 1)
    w_ptrs = (w_ptr + rows[:, None].to(gl.int64) * stride_w
              + gl.arange(0, NW, layout=gl.SliceLayout(0, WL))[None, :])
    srows = gl.minimum(off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, SL)), N - 1)
    s_ptrs = (s_ptr + srows[:, None].to(gl.int64) * stride_s
              + gl.arange(0, NP, layout=gl.SliceLayout(0, SL))[None, :])
    last = k_steps - 1  # steps past the end re-read the last one
    for q in gl.static_range(P - 1):
        j = gl.minimum(first + q * every, last)
        async_copy.async_copy_global_to_shared(w_raw.index(base + q), w_ptrs + j * NW)
        async_copy.async_copy_global_to_shared(s_raw.index(base + q), s_ptrs + j * NP)
        async_copy.commit_group()
    t = 0
    for i in range(first, k_steps, every):
        j = gl.minimum(i + (P - 1) * every, last)
        r = (t + P - 1) % P  # the slot read in the previous iteration
        async_copy.async_copy_global_to_shared(w_raw.index(base + r), w_ptrs + j * NW)
        async_copy.async_copy_global_to_shared(s_raw.index(base + r), s_ptrs + j * NP)
        async_copy.commit_group()
        async_copy.wait_group(P - 1)  # this thread's copies of step i have landed
        wa = w_raw.index(base + t % P).load(WL)
        sa = s_raw.index(base + t % P).load(SL)
        a = _decode_tile(wa, sa, a_bufs.dtype, WL)
        slot = i % S
        mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
        a_bufs.index(slot).store(a)
        mbarrier.arrive(ready.index(slot), count=1)
        t += 1
    async_copy.wait_group(0)


@gluon.jit
def _load_partition(x_desc, x_bufs, ready, empty, off_m, k_steps):
    """Loader warp: x tiles into the ring by TMA (rows past M arrive as zeros)."""
    S: gl.constexpr = x_bufs.shape[0]
    BK: gl.constexpr = x_bufs.shape[2]
    for i in range(k_steps):
        slot = i % S
        mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, i * BK], ready.index(slot),
                                        x_bufs.index(slot))


@gluon.jit
def _mma_partition(a_bufs, x_bufs, ready, empty, k_steps, ACC: gl.constexpr):
    """MMA warpgroup(s): one asynchronous wgmma per step, at most one left in flight; the
    slot of the step before is free once that one is done."""
    S: gl.constexpr = a_bufs.shape[0]
    BN: gl.constexpr = a_bufs.shape[1]
    BM: gl.constexpr = x_bufs.shape[1]
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    for i in range(k_steps):
        slot = i % S
        mbarrier.wait(ready.index(slot), (i // S) & 1)
        # The decoders' generic-proxy stores, ordered before this by the barrier, made
        # visible to wgmma's async proxy here: a fence in the decode warps would wait for
        # their prefetch loads too (it compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC).
        fence_async_shared()
        acc = warpgroup_mma(a_bufs.index(slot), x_bufs.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
    return (warpgroup_mma_wait(0, deps=(acc,)),)  # (warp_specialize flattens a tuple)


@gluon.jit
def _gemm_kernel(
    x_desc, w_ptr, s_ptr, s2_ptr, bias_ptr, out_desc,
    N, stride_w, stride_s,  # w in int32 words, s in int16 pairs
    k_steps,  # K // BK
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    OUT_LOG2: gl.constexpr, DECODERS: gl.constexpr, PREFETCH: gl.constexpr,
    DECODE_REGS: gl.constexpr, RAW_SWIZZLE: gl.constexpr,
    ACC: gl.constexpr, A_SMEM: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    gl.static_assert(BN == BK)  # the epilogue reuses an x slot for the output tile
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BN, BK], A_SMEM)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    if RAW_SWIZZLE:
        # A thread's 32-byte row is two 16-byte pieces; rows 4 apart swap them, so the 8
        # rows a quarter-warp reads at once fill all 32 banks (no 2-way conflicts).
        W_RAW: gl.constexpr = gl.SwizzledSharedLayout(4, 4, 2, [1, 0])
    else:
        W_RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    S_RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    w_raw = gl.allocate_shared_memory(gl.int32, [DECODERS * PREFETCH, BN, BK // 8], W_RAW)
    s_raw = gl.allocate_shared_memory(gl.int16, [DECODERS * PREFETCH, BN, BK // 32], S_RAW)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=2)  # the decoders' arrive + the TMA's expect
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    # Several decode partitions take turns (steps d, d + DECODERS, ...): a few warps
    # cannot hide the decode's latencies (barrier waits, fences, loads).
    if DECODERS == 1:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 1, PREFETCH)),
        ], [1] + [BN // 32] * 1, [24] + [DECODE_REGS] * 1)
    elif DECODERS == 2:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 2, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 2, PREFETCH)),
        ], [1] + [BN // 32] * 2, [24] + [DECODE_REGS] * 2)
    elif DECODERS == 3:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 3, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 3, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 2, 3, PREFETCH)),
        ], [1] + [BN // 32] * 3, [24] + [DECODE_REGS] * 3)
    elif DECODERS == 4:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 4, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 4, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 2, 4, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 3, 4, PREFETCH)),
        ], [1] + [BN // 32] * 4, [24] + [DECODE_REGS] * 4)
    elif DECODERS == 5:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 5, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 5, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 2, 5, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 3, 5, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 4, 5, PREFETCH)),
        ], [1] + [BN // 32] * 5, [24] + [DECODE_REGS] * 5)
    elif DECODERS == 6:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 6, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 6, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 2, 6, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 3, 6, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 4, 6, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 5, 6, PREFETCH)),
        ], [1] + [BN // 32] * 6, [24] + [DECODE_REGS] * 6)
    elif DECODERS == 7:
        (acc,) = gl.warp_specialize([
            (_mma_partition, (a_bufs, x_bufs, ready, empty, k_steps, ACC)),
            (_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_steps)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 0, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 1, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 2, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 3, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 4, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 5, 7, PREFETCH)),
            (_decode_partition, (w_ptr, s_ptr, w_raw, s_raw, a_bufs, ready, empty, off_n, N, stride_w,
                                 stride_s, k_steps, 6, 7, PREFETCH)),
        ], [1] + [BN // 32] * 7, [24] + [DECODE_REGS] * 7)
    else:
        gl.static_assert(DECODERS <= 7)
    y = (acc * (2.0**OUT_LOG2)) * gl.load(s2_ptr)  # the power of two is exact
    if HAS_BIAS:
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        y += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    # The [BM, BN] output tile leaves by TMA from an x slot (all are free now, and BN == BK
    # gives it the same shape and swizzle): whole 128-byte rows instead of scattered
    # 2-byte stores; TMA drops the rows and columns past M and N.
    c_smem = x_bufs.index(0)
    c_smem.store(gl.permute(y.to(x_desc.dtype), (1, 0)))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@functools.cache  # built once per config, not on every linear call
def layouts(bm: int, bk: int, mma_warps: int):
    """(the accumulator, the decoded tile's shared layout)."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[mma_warps, 1],
                                    instr_shape=[16, min(bm, 256), 16])
    a_smem = gl.NVMMASharedLayout(swizzle_byte_width=2 * bk if bk <= 64 else 128,
                                  element_bitwidth=16, rank=2)
    return acc, a_smem


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether K is whole steps of BK."""
    return k % cfg["BK"] == 0


def viewable(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor) -> bool:
    """Whether the weights read as int32 words and int16 pairs, and x and out make TMA
    descriptors (16-byte aligned bases and row strides)."""
    return (packed.data_ptr() % 4 == 0 and scales.data_ptr() % 2 == 0
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                    for t in (x2, out)))


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias) with cfg = dict(BN, BM, BK, STAGES, mma_warps,
    decoders, decode_warps, decode_regs, maxnreg); requires fits() and viewable()."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk, stages, mw = (cfg[key] for key in ("BN", "BM", "BK", "STAGES", "mma_warps"))
    assert fits(m, k, cfg) and bn == bk, (m, k, cfg)
    acc, a_smem = layouts(bm, bk, mw)
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=a_smem.swizzle_byte_width,
                                    element_bitwidth=16, rank=2)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], x_layout)
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn], x_layout)
    words = packed.view(torch.int32)
    pairs = scales.view(torch.int16)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _gemm_kernel[grid](
        x_desc, words, pairs, s2, bias if bias is not None else out, out_desc,
        n, words.stride(0), pairs.stride(0), k // bk,
        HAS_BIAS=bias is not None, BN=bn, BK=bk, STAGES=stages,
        OUT_LOG2=_DECODE[x2.dtype][1], DECODERS=cfg["decoders"], PREFETCH=cfg["prefetch"],
        DECODE_REGS=cfg["decode_regs"], RAW_SWIZZLE=cfg.get("raw_swizzle", True),
        ACC=acc, A_SMEM=a_smem,
        num_warps=mw, maxnreg=cfg["maxnreg"],
    )
    return out
