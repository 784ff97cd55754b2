"""Weight-only NVFP4 linear for Hopper in plain Triton: y = x @ W.T * s2 (+ bias), x in
bf16/fp16. It takes any shape and alignment, so it is the routing table's last row
(routing.py) and runs whatever the Gluon kernels decline.

Hopper has no FP4 tensor cores, and `tl.dot_scaled` with e4m3 scales per 16 does not
compile there, so the weights are decoded in registers (common.py says how, exactly) and
multiplied on the bf16/fp16 tensor cores with `tl.dot` (fp32 accumulation).

Layout of the work ("swap AB"): the weight tile is the left operand, acc[n, m] = W[n, :] .
x[m, :], so a decode step with one token still fills the 64-row MMA of a warpgroup with
weight rows; the token dimension (M) becomes the MMA's narrow N side (16 at least). For
small M the weight stream is the whole cost: 0.5625 bytes per weight instead of 2 for bf16.
To keep enough bytes in flight, small-M calls split K over several programs; the last
program to finish a tile sums the partials (in a fixed order, so results are
deterministic) and writes the output, all in one launch.

The decode's multiply runs on packed pairs (one `mul.rn.bf16x2` per two weights), in
inline PTX when DECODE_ASM, or as plain Triton integer ops otherwise (same values;
triton_configs picks the plain form above 64 tokens, where Triton schedules it better
around the MMAs). The MMA's register fragment pairs K positions (k, k + 1) per thread; K is
reordered inside each step (identically for W and x, see the kernel) so that each
thread's fragment is one contiguous 16-byte run of a weight row and each fragment
register is one decoded pair.

Numerics versus reference.linear: the reference rounds w * s2 to x.dtype for every weight,
then cuBLAS sums bf16 products in fp32 in its own order. Here the weights are exact, the
sum is fp32 in another order, s2 is applied to the fp32 sum, and the result is rounded
once. Both stay within a few units of x.dtype's rounding of the exact sum: tests bound
|y - exact| by a small multiple of eps(x.dtype) * (|x| @ |W|).
"""

import torch
import triton
import triton.language as tl

from ..split_counters import tile_counters
from .common import DECODE, DECODE_BITS_BF16, DECODE_BITS_F16, split_workspace
from .format import BLOCK
from .grid import cdiv
from .launch_cache import Launch, LaunchCache

# PTX for four bytes b0..b3 -> the low-nibble weights of (b0, b1) and (b2, b3) as packed
# 16-bit pairs ($0, $1), and the high-nibble weights likewise ($2, $3), each times its
# block scale ($5 holds the scales of b0, b1; $6 of b2, b3). 17 instructions per 8 weights.
# prmt spreads two bytes into the two halves of a register and fills each half's upper byte
# with copies of the byte's bit 7 (prmt's sign-replicate selector, 8 + byte index): bit 7 is
# the high nibble's sign, so after one shift that puts the nibble's magnitude (byte bits
# 4-6) at bits 6-8 (bf16) or 9-11 (fp16) a copy of its sign sits at bit 15, and one mask
# keeps exactly magnitude and sign. For the low nibbles the same runs on the word shifted
# left by 4, whose byte i has b_i's low nibble in bits 4-7. The multiply by the scale pair
# then gives the signed products (a sign flip commutes with round-to-nearest), -0 included.
_ASM = """
{{
.reg .b32 z, w4, p;
mov.b32 z, 0;
shl.b32 w4, $4, 4;
prmt.b32 p, w4, z, 0x9180;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $0, p, $5;
prmt.b32 p, w4, z, 0xB3A2;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $1, p, $6;
prmt.b32 p, $4, z, 0x9180;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $2, p, $5;
prmt.b32 p, $4, z, 0xB3A2;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $3, p, $6;
}}
"""

_ASM_BF16 = tl.constexpr(_ASM.format(**DECODE_BITS_BF16))
_ASM_F16 = tl.constexpr(_ASM.format(**DECODE_BITS_F16))


@triton.jit
def _decode(packed, scale, DECODE_ASM: tl.constexpr):
    """uint8 bytes [BN, BKH] and their block scales (x.dtype, pre-multiplied) -> the
    weights of the low and the high nibbles, e2m1 * s_b * 2^-9 (bf16) or 2^-7 (fp16)."""
    dtype: tl.constexpr = scale.dtype
    if DECODE_ASM:
        if dtype == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(
                _ASM_BF16, "=r,=r,=r,=r,r,r,r", [packed, scale],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _ASM_F16, "=r,=r,=r,=r,r,r,r", [packed, scale],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
            )
    else:
        # The same bits with plain integer ops, then the scale multiply in x.dtype.
        b = packed.to(tl.int32)
        if dtype == tl.bfloat16:
            mag = (b * 0x00040040) & 0x01C001C0  # low code at bits 6-8, high at 22-24
        else:
            mag = (b * 0x00200200) & 0x0E000E00  # 9-11 and 25-27
        pair = mag | ((b * 0x01001000) & -0x7FFF8000)  # signs to 15 and 31 (0x80008000)
        lo = pair.to(tl.uint16).to(dtype, bitcast=True) * scale
        hi = (pair >> 16).to(tl.uint16).to(dtype, bitcast=True) * scale
    return lo, hi


@triton.jit
def _store_out(acc, offs_n, offs_m, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
               HAS_BIAS: tl.constexpr, OUT_LOG2: tl.constexpr):
    """acc [BN, BM] fp32 (weights carried 2^-OUT_LOG2) -> out[m, n] in x.dtype."""
    y = (acc * (2.0**OUT_LOG2)) * tl.load(s2_ptr)  # the power of two is exact
    n_ok = offs_n < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_m < M)[None, :])


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K] x.dtype, row stride stride_xm, unit stride along K
    w_ptr,  # [N, K/2] uint8, row stride stride_w = K/2
    s_ptr,  # [N, K/16] uint8 (e4m3 bytes), row stride stride_s = K/16
    s2_ptr,  # 0-d fp32
    bias_ptr,  # [N] x.dtype (unused unless HAS_BIAS)
    out_ptr,  # [M, N] x.dtype, row stride stride_om
    ws_ptr,  # fp32 split-K partials [SPLIT_K, tiles, BN, BM] (unused if SPLIT_K == 1)
    cnt_ptr,  # int32 [tiles], zero between launches (unused if SPLIT_K == 1)
    M, N, K, stride_xm, stride_w, stride_s, stride_om,
    k_iters,  # BLOCK_K steps per split
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K == BLOCK_K * k_iters * SPLIT_K: no masks along K
    SCALE_LOG2: tl.constexpr,
    OUT_LOG2: tl.constexpr,
    DECODE_ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    BKH: tl.constexpr = BLOCK_K // 2  # bytes per weight row per step
    BKS: tl.constexpr = BLOCK_K // 16  # scales per weight row per step
    C: tl.constexpr = BLOCK_K // 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[:, None]
    # K steps of this split: a contiguous range of k_iters steps
    k_begin = pid_k * k_iters * BLOCK_K
    K_STEP: tl.constexpr = BLOCK_K
    kh = tl.arange(0, BKH)
    ks = tl.arange(0, BKS)
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k_begin // 2 + kh)[None, :]
    s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_s + (k_begin // 16 + ks)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + kk)[None, :]
    dtype = x_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.range(k_iters):
        if EVEN_K:
            wb = tl.load(w_ptrs, mask=n_ok, other=0)
            sc = tl.load(s_ptrs, mask=n_ok, other=0)
            xt = tl.load(x_ptrs, mask=m_ok, other=0.0)
        else:
            k0 = k_begin + i * K_STEP
            wb = tl.load(w_ptrs, mask=n_ok & ((k0 + 2 * kh) < K)[None, :], other=0)
            sc = tl.load(s_ptrs, mask=n_ok & ((k0 + 16 * ks) < K)[None, :], other=0)
            xt = tl.load(x_ptrs, mask=m_ok & ((k0 + kk) < K)[None, :], other=0.0)
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (2.0**SCALE_LOG2)
        scale = tl.reshape(tl.broadcast_to(scale.to(dtype)[:, :, None], (BLOCK_N, BKS, 8)),
                           (BLOCK_N, BKH))  # one scale per byte
        lo, hi = _decode(wb, scale, DECODE_ASM)
        # Reorder K inside the step, the same way for W and x, so the dot product is
        # unchanged: byte q*2C + 2c + e of a row holds the K positions 2(q*2C + 2c + e) + n
        # (n = 0 low nibble, 1 high); give them the MMA's K index 16c + 8n + 2q + e. The
        # MMA's register fragment then holds, per thread (q = lane % 4), 2C contiguous
        # bytes of a row, read with one 16-byte load, and each of its 32-bit registers is
        # one decoded pair (same nibble of bytes 2c, 2c + 1): exactly what the decode
        # produces, so nothing is shuffled between the load and the tensor cores.
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 4, C, 2, 2))
        w = tl.reshape(tl.permute(w, (0, 2, 4, 1, 3)), (BLOCK_N, BLOCK_K))
        xt = tl.reshape(xt, (BLOCK_M, 4, C, 2, 2))
        xt = tl.reshape(tl.permute(xt, (0, 2, 4, 1, 3)), (BLOCK_M, BLOCK_K))
        acc = tl.dot(w, tl.trans(xt), acc)
        w_ptrs += K_STEP // 2
        s_ptrs += K_STEP // 16
        x_ptrs += K_STEP

    if SPLIT_K == 1:
        _store_out(acc, offs_n, offs_m, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
                   HAS_BIAS, OUT_LOG2)
    else:
        # Publish this partial; the program that brings the tile's count to SPLIT_K sums
        # all partials in split order and writes the output. The barrier makes every
        # thread's stores precede the (single-thread, acq_rel, gpu-scope) atomic.
        tile = pid_m * tl.num_programs(0) + pid_n
        n_tiles = tl.num_programs(0) * tl.num_programs(1)
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_size: tl.constexpr = BLOCK_N * BLOCK_M
        tl.store(ws_ptr + (pid_k * n_tiles + tile).to(tl.int64) * tile_size + tile_offs, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                part = ws_ptr + (s * n_tiles + tile).to(tl.int64) * tile_size + tile_offs
                total += tl.load(part, cache_modifier=".cg")  # L2: written by other SMs
            _store_out(total, offs_n, offs_m, s2_ptr, bias_ptr, out_ptr, N, M, stride_om,
                       HAS_BIAS, OUT_LOG2)
            # ready for the next launch (kernel order sequences it): relaxed, no fence
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


def launch(x2, packed, scales, s2, bias, out, cfg):
    """Run the kernel on x2 [M, K] (unit stride along K) into out [M, N] with config cfg
    (triton_configs.pick_config)."""
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
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_iters = cdiv(cdiv(k, bk), split)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws = split_workspace(x2.device, split * tiles * bn * bm, shared_ws)
        cnt = tile_counters(x2.device, tiles)
    else:
        ws = cnt = out  # never read
    scale_log2, out_log2 = DECODE[x2.dtype]
    return (
        grid,
        (x2, packed, scales.view(torch.uint8), s2, bias if bias is not None else out, out,
         ws, cnt, m, n, k, x2.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
         k_iters),
        dict(HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split,
             EVEN_K=k == bk * k_iters * split, SCALE_LOG2=scale_log2, OUT_LOG2=out_log2,
             DECODE_ASM=cfg["DECODE_ASM"]),
        dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        None,
    )


_LAUNCHES = LaunchCache(_linear_kernel)  # a memo of compiled launches, as Triton's own cache

assert BLOCK == 16  # the kernel hard-codes 16-element blocks (BLOCK_K // 16 scales per row)
