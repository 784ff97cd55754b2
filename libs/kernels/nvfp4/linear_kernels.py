"""Weight-only NVFP4 linear for Hopper in Triton: y = x @ W.T * s2 (+ bias), x in bf16/fp16.

Hopper has no FP4 tensor cores, and `tl.dot_scaled` with e4m3 scales per 16 does not
compile there, so the weights are decoded in registers and multiplied on the bf16/fp16
tensor cores with `tl.dot` (fp32 accumulation).

Layout of the work ("swap AB"): the weight tile is the left operand, acc[n, m] = W[n, :] .
x[m, :], so a decode step with one token still fills the 64-row MMA of a warpgroup with
weight rows; the token dimension (M) becomes the MMA's narrow N side (16 at least). For
small M the weight stream is the whole cost: 0.5625 bytes per weight instead of 2 for bf16,
so the ceiling is 3.56x a bf16 GEMV. To keep enough bytes in flight, small-M calls split K
over several programs; the last program to finish a tile sums the partials (in a fixed
order, so results are deterministic) and writes the output, all in one launch.

Decoding, per byte (two E2M1 codes, element 2i in the low nibble):
- Put a code's 3 magnitude bits where the top exponent/mantissa bits of a 16-bit float
  start: for bf16 `(c & 7) << 6`, for fp16 `(c & 7) << 9`, and its sign at bit 15. That 16-bit
  pattern IS the E2M1 value times 2^-126 (bf16) or 2^-14 (fp16): E2M1's exponent bias is 1,
  and its subnormal (code 1 = 0.5) lands on the 16-bit format's subnormal.
- Multiply by the block scale pre-multiplied by 2^117 (bf16) or 2^7 (fp16), giving
  e2m1 * s_b * 2^-9 (resp. 2^-7). e2m1 has 2 significant bits and s_b 4, so the product
  has at most 6 and is exact in either format, including the fp16 subnormals it can reach
  (>= 2^-17, with its last bit >= 2^-22 > 2^-24). The epilogue multiplies by 2^9 (2^7) and
  s2. The multiply runs on packed pairs (one `mul.rn.bf16x2` per two weights), in inline
  PTX when DECODE_ASM, or as plain Triton integer ops otherwise (same values).

The MMA's register fragment pairs K positions (k, k + 1) per thread; K is reordered inside
each step (identically for W and x, see the kernel) so that each thread's fragment is one
contiguous 16-byte run of a weight row and each fragment register is one decoded pair.

Speed on an H200 (bench/nvfp4_kernels_bench.py, CUDA graphs, weights streamed from HBM):
M = 1 on 8192 x 28672 runs in 60 us against 111 us for torch's bf16 GEMV (1.85x; the bytes
allow 3.56x). Earlier ncu (64 us version): 62% issue utilisation at 14 warps per SM, DRAM
43% busy. Cutting the decode from 22 to 17 instructions per 8 weights (loop 304 -> 264
SASS per 64 weights) gained only ~1%, and many tile/split/stage variants all land at
59.5-63 us, so the per-step latency of this structure (barriers, the synchronous wgmma
chain), not the instruction count, bounds it now. M = 64 is ~1.1x
and M = 256 ~0.55x of torch: there the decode competes with the tensor cores. SmolLM2's
576-wide layers are launch/latency-bound (5.5 us vs 3.6 us for torch).

`route` picks the kernel: at most 8 tokens on layers of at least 2^23 weights go to
gemv_kernel.py (a Gluon `mma.sync` GEMV without that per-step chain: ~39 us on 8192 x 28672
at M = 1, x staged in shared memory), 17 tokens or more on layers of at least 2^24 weights
to gemm_kernel.py (a warp-specialized Gluon GEMM whose MMA warpgroup decodes into wgmma's
register operand while its previous wgmma runs: ~155 us at M = 256, torch 171-175 us; 75 us
at M = 64, torch 128-142 us), layers under 2^22 weights with K up to 576 to small_kernel.py
(one decode per tile of 16-32 weight rows into shared memory, then wgmma with x as A, by
TMA or up to 32 tokens straight into registers: SmolLM2's 576 x 576 at M = 256 in ~3.5 us
against ~5.6 us here, at M = 1 ~2.7 against ~4.9 us), 17 tokens or more on small layers
with longer K (SmolLM2's down projection, K = 1536; past 32 tokens where few_tokens says so,
and not where small_phased_kernel.long_and_light does)
to small_phased_kernel.py (the same
form with x streamed through a ring of shared buffers: ~5.0 against ~6.3 us here at M =
128, ~5.8 against the GEMM's ~6.4 at M = 256), and the small layers both decline at 129-256
tokens to gemm_kernel.py; everything else runs here. Prompts on layers of up to 2^22
weights in bf16 take the reference's own route instead where it was measured faster than
the kernel picked (dequantize_route.py): dequantize into a bf16 scratch weight, then cuBLAS.

Numerics versus reference.linear: the reference rounds w * s2 to x.dtype for every weight,
then cuBLAS sums bf16 products in fp32 in its own order. Here the weights are exact, the
sum is fp32 in another order, s2 is applied to the fp32 sum, and the result is rounded
once. Both stay within a few units of x.dtype's rounding of the exact sum: tests bound
|y - exact| by a small multiple of eps(x.dtype) * (|x| @ |W|).
"""

import functools
import importlib

import torch
import triton
import triton.language as tl

from .dequantize_route import takes_dequantize_route
from .format import BLOCK
from .grid import cdiv
from .launch_cache import Launch, LaunchCache

# Per x.dtype: (log2 of the factor folded into the block scale, log2 of the factor the
# epilogue puts back). See the module docstring.
_DECODE = {torch.bfloat16: (117, 9), torch.float16: (7, 7)}

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
# Where a nibble's bits land in each 16-bit type after the shift, and the mask that keeps
# sign, exponent and mantissa bits: shared by every decode here and in the Gluon kernels.
DECODE_BITS_BF16 = dict(sh=2, mask="0x81C081C0", ty="bf16")
DECODE_BITS_F16 = dict(sh=5, mask="0x8E008E00", ty="f16")
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
    K_INTERLEAVE: tl.constexpr,  # split programs take interleaved K steps
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
    # K steps of this split: a contiguous range, or (K_INTERLEAVE) every SPLIT_K-th step, so
    # the split programs of a tile read neighbouring chunks of each weight row at about the
    # same time (longer runs per DRAM row than one 64-byte chunk per row per program).
    if K_INTERLEAVE:
        k_begin = pid_k * BLOCK_K
        K_STEP: tl.constexpr = SPLIT_K * BLOCK_K
    else:
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


# Default decode when a config does not say: the inline-PTX packed version (same values as
# the plain Triton one; tests check that bit for bit).
DECODE_ASM = True

_counters: dict[tuple, torch.Tensor] = {}


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for split-K, one buffer per (device, stream).

    Every launch leaves the counters it used at zero again, so the buffer is reused without
    a memset. It is keyed by stream because two launches running at once must not share
    counters."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


_workspaces: dict[tuple, torch.Tensor] = {}


def split_workspace(device: torch.device, numel: int, shared: bool) -> torch.Tensor:
    """fp32 room for split-K partials: a fresh tensor, or (shared: for bound launches,
    which keep theirs across calls) one buffer per (device, stream), grown as needed. As
    with the counters, launches on one stream run one after another, so they can share
    it; a buffer kept a workspace per bound launch instead would hold up to a few MB a
    weight and token count."""
    if not shared:
        return torch.empty(numel, dtype=torch.float32, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


@functools.cache
def _gluon(name: str):
    """The Gluon module gemv_kernel, gemm_kernel or small_kernel (each imports this one), or
    None where Triton has no Gluon."""
    try:
        return importlib.import_module(f".{name}", __package__)
    except ImportError:
        return None


@functools.cache  # asked on every linear; a device's SM count does not change
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (TRITON_INTERPRET=1) on CPU tensors
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Tile sizes, split-K and decode for an [m, k] x [n, k]^T product: a heuristic from
    `python -m bench.nvfp4_kernels_bench --tune` on an H200 (see docs in that script).

    Each program decodes its weight tile in registers and waits for its tensor-core work
    before reusing them, so throughput comes from several programs per SM overlapping one
    another: K is split until there are about six programs per SM (three for the larger
    8-warp tiles; at least two K steps each). Small M streams weights: 64-row tiles (128
    rows and ~2 programs per SM on layers with K >= 8192), a 16-wide token side, the
    inline-PTX decode. Larger M is tensor-core work: 128-row tiles
    on two warpgroups; above M = 64 the plain Triton decode measured faster (Triton
    schedules it better around the MMAs).
    Small layers (SmolLM2's) are latency-bound. Few tokens (few_tokens): K split into
    whole runs of steps (_small_layer_split). More tokens: K in runs of at most 576, each
    run's loads all in flight at once, 32-token tiles where they still make 64 tiles
    (_small_layer_runs)."""
    return _config(m, n, k, sms, few_tokens(m, n, k, sms))


def _config(m: int, n: int, k: int, sms: int, few: bool) -> dict:
    """pick_config's config, with or without its few-token form (few)."""
    # Long rows: 128-row GEMV tiles measured 59.8 vs 62.4 us (64-row) on 8192 x 28672 at
    # M = 1, but 9.4 vs 9.0 us on 4096 x 4096, which keeps 64-row tiles.
    big = n >= 2048 and k >= 8192
    small = n * k < 2**22
    per_sm = 6 if few else 3  # the 8-warp tiles need fewer programs per SM
    if few:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                   DECODE_ASM=True)
        if k <= 768:
            cfg["BLOCK_K"] = 64
        if big:  # 128 weight rows per warpgroup (two independent MMA chains), ~2 per SM
            cfg["BLOCK_N"] = 128
            per_sm = 2
    elif small:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64 if k < 1024 else 128, num_warps=4,
                   num_stages=3, DECODE_ASM=True)
        if cdiv(n, 64) * cdiv(m, 32) >= 64:  # 576 x 576 at M = 256: 5.5 vs 5.8 us
            cfg["BLOCK_M"] = 32
    elif m <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3,
                   DECODE_ASM=True)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3,
                   DECODE_ASM=False)
        # (x permuted once in memory and fed to the MMAs from shared memory measured 280 vs
        # 312 us here, but Triton 3.6 then lets the next step's decode overwrite registers
        # that in-flight wgmmas still read: a race, removed. docs/notes/nvfp4-triton.md.)
    # The masked K path (K not a multiple of BLOCK_K * SPLIT_K) loses the 16-byte loads and
    # measured 3.5x slower, so take the largest K step (down to 16, which always divides K)
    # that divides K, and only splits that divide the number of steps.
    while k % cfg["BLOCK_K"] and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    k_steps = cdiv(k, cfg["BLOCK_K"])
    if small:
        if few:
            cfg["SPLIT_K"] = _small_layer_split(k_steps, tiles, sms)
        else:
            _small_layer_runs(cfg, k_steps)
        return cfg
    split_k = 1
    if k > 768:
        while (tiles * split_k * 2 <= per_sm * sms and k_steps // (split_k * 2) >= 2
               and k_steps % (split_k * 2) == 0):
            split_k *= 2
    cfg["SPLIT_K"] = split_k
    return cfg


def few_tokens(m: int, n: int, k: int, sms: int = 132) -> bool:
    """Whether pick_config's few-token config (16-token tiles of 64 rows, K split into runs)
    takes the call: up to 16 tokens, and 17-32 on layers of under 2^22 weights where K is
    2048 or more (eight or more of small_phased_kernel's phases, whose 32-row boxes are slow
    there), or 1536 or more with that config's programs in one wave; small_phased_kernel
    then declines them. One H200, five interleaved rounds (docs/notes/nvfp4-triton.md,
    session `ring-sweep`), us at M = 17 / 32, this config against small_phased_kernel
    (torch):
    - 512 x 2048 (128 programs) 4.74 / 4.62 against 6.23 / 6.22 (5.70 / 5.76);
    - 1536 x 2048 (384) 6.03 / 5.84 against 6.54 / 6.49 (5.98 / 5.99);
    - 576 x 1536 (108) 4.42 / 4.40 against 4.54 / 4.55 (5.01 / 5.06);
    - 960 x 1536 (180, past one wave) 5.11 / 5.09 against 4.64 / 4.62: the phased kernel;
    - K of 1280 and less keep the phased kernel: 576 x 1280 4.32 / 4.36 against 4.06 /
      4.07, 1024 x 1024 4.39 / 4.41 against 3.80 / 3.73; so do 33 tokens and more."""
    if m <= 16:
        return True
    if m > 32 or n * k >= 2**22 or k < 1536:
        return False
    if k >= 2048:
        return True
    cfg = _config(m, n, k, sms, few=True)
    return cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"]) * cfg["SPLIT_K"] <= sms


def _small_layer_split(k_steps: int, tiles: int, sms: int) -> int:
    """SPLIT_K for a layer of under 2^22 weights (SmolLM2's) at up to 16 tokens: the largest
    number of whole runs of at least two K steps that keeps to about four programs an
    SM. Large-layer tiles leave most SMs idle there, and a split need not be a power of
    two, only divide the steps (SmolLM2's 576 is nine 64-wide steps). From a sweep on an
    H200 (docs/notes/nvfp4-triton.md, session `gemm-lookahead`): runs of two (576 x 576 at
    M = 1: 4.9 against 5.4 us whole)."""
    return max(s for s in range(1, k_steps + 1)
               if k_steps % s == 0 and (s == 1 or (k_steps // s >= 2
                                                   and tiles * s <= 4 * sms)))


def _small_layer_runs(cfg: dict, k_steps: int) -> None:
    """SPLIT_K and num_stages for a small layer at more than 16 tokens: the fewest runs of
    at most 576 of K that divide the steps, and a software pipeline one deeper than a run
    (at most 10), so every load of a run is issued before the first step is decoded. Each
    program is one latency chain (loads, then per step a decode and a wgmma it waits for),
    and a global split-K sum adds a round trip, so long runs whose loads all fly at once
    beat short ones. From a sweep on an H200 (docs/notes/nvfp4-triton.md, session
    `small-pipelines`): 576 x 576 at M = 256 5.6 against 6.2 us (runs of three steps, three
    stages), 576 x 1536 7.7 against 9.0 us, at M = 64 5.3 against 6.2 us."""
    cfg["SPLIT_K"] = min(s for s in range(1, k_steps + 1)
                         if k_steps % s == 0 and k_steps // s * cfg["BLOCK_K"] <= 576)
    cfg["num_stages"] = min(k_steps // cfg["SPLIT_K"] + 1, 10)


def launch(x2, packed, scales, s2, bias, out, cfg, decode_asm=None):
    """Run the kernel on x2 [M, K] (unit stride along K) into out [M, N] with config cfg."""
    _LAUNCHES(*_call(x2, packed, scales, s2, bias, out, cfg, decode_asm, shared_ws=False))
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment. Its split-K workspace and counters are the current stream's, so the
    caller keeps one Launch a stream."""
    return _LAUNCHES.bind(*_call(x2, packed, scales, s2, bias, out, cfg, None, shared_ws=True),
                          x2, out)


def _call(x2, packed, scales, s2, bias, out, cfg, decode_asm, shared_ws: bool) -> tuple:
    """(grid, runtime args, constexprs, options, static key) of one launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_iters = cdiv(cdiv(k, bk), split)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws = split_workspace(x2.device, split * tiles * bn * bm, shared_ws)
        cnt = _tile_counters(x2.device, tiles)
    else:
        ws = cnt = out  # never read
    scale_log2, out_log2 = _DECODE[x2.dtype]
    return (
        grid,
        (x2, packed, scales.view(torch.uint8), s2, bias if bias is not None else out, out,
         ws, cnt, m, n, k, x2.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
         k_iters),
        dict(HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split,
             EVEN_K=k == bk * k_iters * split, SCALE_LOG2=scale_log2, OUT_LOG2=out_log2,
             DECODE_ASM=cfg.get("DECODE_ASM", DECODE_ASM) if decode_asm is None else decode_asm,
             K_INTERLEAVE=bool(cfg.get("K_INTERLEAVE")) and split > 1),
        dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
             **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})),
        None,
    )


_LAUNCHES = LaunchCache(_linear_kernel)  # a memo of compiled launches, as Triton's own cache


def route(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
          out: torch.Tensor) -> tuple[str, dict]:
    """How out = x2 @ W.T is computed: the kernel _pick_kernel names, or ("dequantize", {})
    where dequantize + cuBLAS beat it (prompts on layers of up to 2^22 weights in bf16:
    dequantize_route.py)."""
    kernel, cfg = _pick_kernel(x2, packed, scales, out)
    m, k = x2.shape
    if x2.is_cuda and takes_dequantize_route(kernel, m, packed.shape[0], k, x2.dtype):
        return "dequantize", {}
    return kernel, cfg


def _pick_kernel(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 out: torch.Tensor) -> tuple[str, dict]:
    """Which kernel computes out = x2 @ W.T, and its config: ("gemv", cfg) for a few tokens
    on long rows (gemv_kernel), ("small", cfg) for small layers with K up to 576
    (small_kernel), ("small_phased", cfg) for more tokens than few_tokens on small layers
    with longer K (small_phased_kernel), ("gemm", cfg) for many tokens on large layers and on
    the small layers both decline (gemm_kernel), else ("triton", cfg) for this module's
    kernel. The Gluon kernels need CUDA tensors (Gluon has no CPU interpreter) and
    addresses they can read as words or TMA descriptors."""
    m, k = x2.shape
    n = packed.shape[0]
    sms = _sm_count(x2.device)
    if x2.is_cuda:
        gemv = _gluon("gemv_kernel")
        cfg = gemv and gemv.viewable(packed, scales) and gemv.pick_config(m, n, k, sms)
        if cfg:
            return "gemv", cfg
        small = _gluon("small_kernel")
        cfg = small and small.readable(x2, packed) and small.pick_config(m, n, k, sms)
        if cfg:
            return "small", cfg
        phased = _gluon("small_phased_kernel")
        cfg = phased and phased.readable(x2, packed) and phased.pick_config(m, n, k, sms)
        if cfg:
            return "small_phased", cfg
        gemm = _gluon("gemm_kernel")
        cfg = gemm and gemm.viewable(x2, packed, scales, out) and gemm.pick_config(m, n, k, sms)
        if cfg:
            return "gemm", cfg
    return "triton", pick_config(m, n, k, sms)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    s2: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Weight-only y = x @ W.T + bias in x.dtype; see the module docstring for numerics.

    fp32 activations take the reference's route (Triton dequantize, then torch's fp32
    matmul): the fp32 tensor cores would round x to tf32, and fp32 is not a serving dtype."""
    if x.dtype == torch.float32:
        from .triton_impl import dequantize

        w = dequantize(packed, scales, s2, torch.float32)
        return torch.nn.functional.linear(x, w, bias)
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = x.dim() == 2  # the engine's case: no reshapes (each costs microseconds of host)
    x2 = x if flat else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        if s2.dtype != torch.float32 or s2.device != x.device:
            s2 = s2.to(device=x.device, dtype=torch.float32)
        kernel, cfg = route(x2, packed, scales, out)
        if kernel == "dequantize":
            out = dequantize_linear(x2, packed, scales, s2, bias)
        else:
            run = launch if kernel == "triton" else _gluon(f"{kernel}_kernel").launch
            run(x2, packed, scales, s2, bias, out, cfg)
    return out if flat else out.reshape(*x.shape[:-1], n)


def dequantize_linear(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      s2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The dequantize route (dequantize_route.py): reference.linear's computation, the
    weight dequantized to x2.dtype by the Triton kernel, so its numerics bit for bit."""
    from .triton_impl import dequantize

    return torch.nn.functional.linear(x2, dequantize(packed, scales, s2, x2.dtype), bias)


assert BLOCK == 16  # the kernel hard-codes 16-element blocks (BLOCK_K // 16 scales per row)
