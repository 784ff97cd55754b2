"""Triton quantize kernel for NVFP4, bit-exact with reference.quantize (and so ModelOpt).

Every result is that of the reference's IEEE fp32 operations in the same order: the block
amax, one rounded product c = 6 * s2, the correctly rounded block scale fl(amax / c), the
clamp to [2^-9, 448], the e4m3 rounding (nearest even), the rounded product
d = fp32(s_b) * s2, then per element the E2M1 code of fl(x / d), round to nearest even,
with the reference's saturation and sign rules. Where a step is computed another way
(below), the docstring of its function says why the bits are the same, and
tests/kernels/test_nvfp4_quantize_steps.py checks it over every input it can get.

Speed: an 8192 x 8192 quantize moves 172 MB (bf16 in) or 306 MB (fp32 in), so at an H200's
~4.2 TB/s it has ~40-75 us, and per element only a couple of dozen instructions fit in that.
What keeps it there:
- no division per element: fl(x / d) comes from the block's reciprocal and Markstein
  correction steps, exact for every input (_codes_fast's docstring, and
  tests/kernels/test_markstein.py); a correctly rounded division costs ~11 instructions
  per element and would make this kernel instruction-bound;
- the E2M1 rounding as a minimum of three rounded fp32 additions (_magnitude_bits), on
  the FMA pipe rather than the integer unit, which has half its throughput;
- a short block prologue (~21 instructions): the block scale without
  a division (_block_scale), the e4m3 rounding by the hardware's conversion
  (_round_e4m3), the reciprocal without its slow path (_reciprocal), the sign bound in
  two products (_negative_bound), and the scale bytes stored by the threads that own
  their blocks, without a regrouping through shared memory and its two barriers;
- for bf16, the eight signs of a half block decided together on bf16 pairs (_sign_bits);
- one thread owns whole blocks (two 16-byte halves for 16-bit inputs, four quarters for
  fp32), so the amax and the block scale need no shuffles and are computed once;
- each program loops over tiles and loads the next tile before encoding this one, so a
  thread's loads are in flight while it computes (with one tile per program the memory
  system would sit idle between a warp's load and its long stretch of arithmetic);
- bf16 is read as int32 words of two elements: a bf16 is the top half of its fp32, so
  one shift or one mask per element, and no register shuffles for bf16 values carried
  through the loop.
With bf16 in, a thread's loop iteration (two blocks, 32 elements) is 522 SASS
instructions, ~16.3 an element.
"""

import triton
import triton.language as tl

# s2 range of the division-free path: every d = fp32(s_b) * s2 is then in [2^-89, 2^89],
# far from fp32's underflow and overflow (see _codes_fast). Outside it (only a caller's
# global_scale, or a tensor near fp32's limits, gets there) each element is divided.
FAST_S2_MIN = 2.0**-80
FAST_S2_MAX = 2.0**80


@triton.jit
def _round_e4m3(s):
    """fp32 s in [2^-9, 448] -> (s rounded to nearest even on the e4m3 grid, as fp32; its
    float8_e4m3fn byte).

    One hardware conversion each way (SM89 and later), the rounding mode written in the
    PTX rather than left to a lowering: `cvt.rn.satfinite.e4m3x2.f32` rounds to nearest
    even, the subnormal steps of 2^-9 below 2^-6 included, and e4m3x2 -> f16x2 is exact.
    An integer rounding would take ~14 instructions a block;
    tests/kernels/test_nvfp4_quantize_steps.py checks it against torch's cast on every
    fp32 in [2^-9, 448]."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 pair, half_lo, half_hi;
        .reg .b32 halves;
        .reg .f32 zero;
        mov.f32 zero, 0f00000000;
        cvt.rn.satfinite.e4m3x2.f32 pair, zero, $2;
        cvt.u32.u16 $1, pair;
        cvt.rn.f16x2.e4m3x2 halves, pair;
        mov.b32 {half_lo, half_hi}, halves;
        cvt.f32.f16 $0, half_lo;
        }""",
        "=r,=r,r",
        [s],
        dtype=(tl.float32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _block_scale(amax, c, y_c, c_cap, c_zero, FAST: tl.constexpr, STEPS: tl.constexpr):
    """s_b = fl(amax / c) with c = fl(6 * s2), 1.0 where that is 0 (an all-zero block),
    clamped to [2^-9, 448]: reference.block_scales before its e4m3 rounding.

    FAST: no division. The quotient comes from y_c = fl(1 / c) and STEPS Markstein steps,
    exact for 16-bit amax in one step and for fp32 in two (_codes_fast's docstring) while
    the quotient is a normal fp32, which covers every quotient the clamp keeps. Around
    that: amax is capped at c_cap = c * 2^20 first (a larger quotient clamps to 448
    anyway, and the cap keeps the steps finite), and fl(amax / c) is 0 exactly when
    amax / c <= 2^-150, tested as amax * 2^104 <= c_zero = c * 2^-46: in the fast s2
    range both sides are exact, and a product past fp32's range is inf, never <=. This
    saves ~6 instructions a block over the correctly rounded division."""
    if FAST:
        a = tl.minimum(amax, c_cap)
        s_b = a * y_c
        for _ in tl.static_range(STEPS):
            s_b = tl.fma(tl.fma(s_b, -c, a), y_c, s_b)
        s_b = tl.minimum(tl.maximum(s_b, 0.001953125), 448.0)  # [2^-9, 448]
        return tl.where(amax * 2.0**104 <= c_zero, 1.0, s_b)
    else:
        s_b = tl.div_rn(amax, c)
        s_b = tl.where(s_b == 0.0, 1.0, s_b)  # all-zero block: store 1.0
        return tl.minimum(tl.maximum(s_b, 0.001953125), 448.0)  # [2^-9, 448]


@triton.jit
def _reciprocal(d):
    """fl(1 / d), correctly rounded, for a normal d whose reciprocal is normal too (the fast
    s2 range keeps every d in [2^-89, 2^89]): the hardware's approximation and one Newton
    step, which is PTX rcp.rn's own fast path without its range test and slow-path call
    (tests/kernels/test_nvfp4_quantize_steps.py compares the two over that range)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 approx, err;
        rcp.approx.ftz.f32 approx, $1;
        fma.rn.f32 err, $1, approx, 0fBF800000;
        neg.f32 err, err;
        fma.rn.f32 $0, approx, err, approx;
        }""",
        "=r,r",
        [d],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _negative_bound(d):
    """The bits of d * 2^-150 rounded down to an fp32, with the sign bit set (_codes_fast).

    Two products: d / 2, exact, then (d / 2) * 2^-149 rounded toward zero, which is that
    bound whether it is subnormal (floor(d / 2) steps of 2^-149) or normal."""
    return tl.inline_asm_elementwise(
        """{
        .reg .f32 half;
        mul.rn.f32 half, $1, 0f3F000000;
        mul.rz.f32 half, half, 0f00000001;
        mov.b32 $0, half;
        or.b32 $0, $0, 0x80000000;
        }""",
        "=r,r",
        [d],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _magnitude_code(b, q):
    """E2M1 magnitude code (0..7) of a non-negative fp32 q whose bits, capped at those of
    6.0, are b; round to nearest even on {0, 0.5, 1, 1.5, 2, 3, 4, 6}:
    - q >= 1: the grid is a float with one mantissa bit, so round b at bit 22 (ties to
      even); the rounded exponent/mantissa field minus 252 is the code (6.0 gives 7);
    - q < 1: the grid step is 0.5; adding 2^22 (whose fp32 ulp is 0.5) rounds q to a
      multiple of 0.5, ties to even, and the low bits of the sum count the halves."""
    big = (b + (0x1FFFFF - (252 << 22)) + ((b >> 22) & 1)) >> 22
    small = (q + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000
    return tl.where(b < 0x3F800000, small, big)


@triton.jit
def _codes_fast(x, d, y, neg_bound, STEPS: tl.constexpr, SIGNED: tl.constexpr = True):
    """E2M1 codes (int32 0..15) of fl(x / d), without a division per element.

    The quotient: q = fl(|x| * y) with y = fl(1 / d), then STEPS Markstein corrections
    q += fl(|x| - q d) * y, each two fused multiply-adds. One step gives exactly fl(|x| / d)
    for every bf16 and fp16 significand against every fp32 d (exhaustive:
    tests/kernels/markstein_check.c); two steps are the textbook proof for fp32 x (the
    first makes q faithful, Markstein's theorem does the rest). Valid while no step
    underflows or overflows, which the s2 range ensures for every quotient that can reach
    0.25, the smallest one with a nonzero magnitude code. A quotient beyond fp32 ends as
    inf or as the NaN of inf - inf: both saturate to 6 here, as the true quotient does.

    The sign is exact on its own: the reference's `fl(x / d) < 0` holds exactly when
    x < -d * 2^-150 (below that the quotient rounds to -0.0), and neg_bound is the bits of
    d * 2^-150 rounded down to an fp32, with the sign bit set, so an unsigned compare of
    x's bits decides it (only negative x can exceed it; -0.0 never does). SIGNED=False
    leaves the sign bit to the caller (_sign_bits does eight at once for bf16)."""
    ax = _abs(x)
    q = ax * y
    for _ in tl.static_range(STEPS):
        q = tl.fma(tl.fma(q, -d, ax), y, q)  # -d, not -q: q's product stays shared
    # The sign goes onto the float's bits before the bias comes off, so that the compiler
    # can fold the bias into the packing's constants.
    code_bits = _magnitude_bits(q)
    if SIGNED:
        code_bits = _add_sign(code_bits, x, neg_bound)
    return code_bits - 0x4B000000


@triton.jit
def _abs(x):
    """|x| in PTX, where the hardware takes it as an operand modifier, free. LLVM rewrites
    tl.abs of a float cut from integer bits into an integer AND, one more instruction an
    element."""
    return tl.inline_asm_elementwise(
        "abs.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _add_sign(code, x, neg_bound):
    """code + 8 where x's bits exceed neg_bound (already with the sign bit set) as unsigned
    ints. In PTX so that it stays one compare and one predicated add: the plain
    `code + where(...)` compiled to a compare, an add and a predicated move."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.gt.u32 p, $2, $3;
        mov.b32 $0, $1;
        @p add.s32 $0, $0, 8;
        }""",
        "=r,r,r,r",
        [code, x.to(tl.int32, bitcast=True), neg_bound],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _magnitude_bits(q):
    """The bits of the fp32 2^23 + code, code the E2M1 magnitude code (0..7) of a
    non-negative fp32 q (inf and NaN saturate), found in fp32 arithmetic, which has twice
    the integer unit's throughput.

    The code is min(RNE(2q), RNE(q) + 2, RNE(q / 2) + 4, 7): each term is the code on one
    stretch of the grid (steps of 0.5 below 2, of 1 from 2 to 4, of 2 above), with the
    grid's ties to even, and is larger than the code elsewhere. Each RNE is one rounded
    addition of 2^23 (an fp32 ulp of 1 there), so the sums are integers 2^23 + code,
    compared as floats: a NaN loses every comparison, so min(NaN, 2^23 + 7) is 7."""
    t1 = tl.fma(q, 2.0, 8388608.0)
    t2 = q + 8388610.0  # 2^23 + 2
    t3 = tl.fma(q, 0.5, 8388612.0)  # 2^23 + 4
    m = tl.minimum(tl.minimum(tl.minimum(t1, t2), t3), 8388615.0)
    return m.to(tl.int32, bitcast=True)  # 0x4B000000 + code


@triton.jit
def _codes_divided(x, d):
    """E2M1 codes of fl(x / d) through a correctly rounded division, for any d > 0 or 0:
    d * 2^-150 or 1 / d may leave fp32's range here, and d may be 0 (then x / d is inf,
    which saturates, or the NaN of 0 / 0, which the reference encodes as 0)."""
    q = tl.div_rn(x, d)
    b = tl.minimum(q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0x40C00000).to(tl.int32)
    code = tl.where(q != q, 0, _magnitude_code(b, tl.abs(q)))
    return code | tl.where(q < 0, 8, 0)


@triton.jit
def _codes(x, d, y, neg_bound, FAST: tl.constexpr, STEPS: tl.constexpr,
           SIGNED: tl.constexpr = True):
    if FAST:
        return _codes_fast(x, d[:, None], y[:, None], neg_bound[:, None], STEPS, SIGNED)
    else:
        return _codes_divided(x, d[:, None])


@triton.jit
def _word(codes, W: tl.constexpr):
    """[R, W] codes -> [R] int32: code i in bits 4i..4i+3 (element 2i in the low nibble of
    byte i, so the word's little-endian bytes are the packed bytes)."""
    return tl.sum(codes << (tl.arange(0, W) * 4)[None, :], axis=1)


@triton.jit
def _load_tile(x_ptr, tile, n_blocks, BLOCKS: tl.constexpr, W: tl.constexpr, PAIRS: tl.constexpr):
    """A tile of BLOCKS blocks as four [BLOCKS, W] parts of 16 bytes each, so that one
    thread owns a whole block: Triton gives a thread at most 16 contiguous bytes of a row.
    W = 4 for fp32; W = 8 for 16-bit inputs, which have two parts (the last two returned
    are copies, unused). Masked lanes are left undefined (no zero fill): their results
    are never stored."""
    blocks = tile.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)  # int64: > 2^31 elements
    P: tl.constexpr = W // 2 if PAIRS else W  # x_ptr elements per part: 16 bytes
    row = x_ptr + blocks[:, None] * (8 if PAIRS else 16) + tl.arange(0, P)[None, :]
    mask = blocks[:, None] < n_blocks
    x0 = tl.load(row, mask=mask)
    x1 = tl.load(row + P, mask=mask)
    if W == 4:
        x2 = tl.load(row + 8, mask=mask)
        x3 = tl.load(row + 12, mask=mask)
    else:
        x2 = x0
        x3 = x1
    return x0, x1, x2, x3


@triton.jit
def _to_float(x, PAIRS: tl.constexpr):
    """A part of the tile as fp32 [BLOCKS, 8] (exact). PAIRS: x is [BLOCKS, 4] int32 words
    each holding two bf16 (element 2j low): a bf16 is the top half of its fp32, so one
    shift or one mask per element, and the loop carries plain words (bf16 values carried
    through the loop cost register shuffles)."""
    if PAIRS:
        even = (x << 16).to(tl.float32, bitcast=True)
        odd = (x & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(even, odd), (x.shape[0], 2 * x.shape[1]))
    else:
        return x.to(tl.float32)


@triton.jit
def _sign_bits(words, neg_bound, codes):
    """codes (the packed magnitudes of a block half, eight elements) with each element's
    sign bit (bit 4i + 3) set as _add_sign would, from the half's [BLOCKS, 4] bf16 pair
    words: 10 instructions for the eight signs instead of 16.

    An element with bits x16 (as bf16) has _add_sign's x16 << 16 > neg_bound exactly when
    x16 > neg_bound >> 16 as unsigned 16-bit ints, which for a bound with the sign bit set
    is the bf16 comparison x < that bound (larger magnitude bits are more negative; -0 and
    positive x are never below it). One `set` compares both elements of a word; four byte
    permutes gather the lanes' all-ones-or-zero results into the elements' byte order."""
    w = tl.reshape(words, (words.shape[0], 2, 2))
    w02, w13 = tl.split(w)
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 bound, m0, m1, m2, m3, p, q, lo, hi;
        prmt.b32 bound, $5, $5, 0x3232;
        set.lt.u32.bf16x2 m0, $1, bound;
        set.lt.u32.bf16x2 m1, $2, bound;
        set.lt.u32.bf16x2 m2, $3, bound;
        set.lt.u32.bf16x2 m3, $4, bound;
        prmt.b32 p, m0, m1, 0x6240;
        prmt.b32 q, m2, m3, 0x6240;
        prmt.b32 lo, p, q, 0x5410;
        prmt.b32 hi, p, q, 0x7632;
        and.b32 lo, lo, 0x08080808;
        and.b32 hi, hi, 0x80808080;
        or.b32 $0, $6, lo;
        or.b32 $0, $0, hi;
        }""",
        "=r,r,r,r,r,r,r",
        [w0, w1, w2, w3, neg_bound, codes],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _quantize_tile(
    x0, x1, x2, x3, tile, s2, c, y_c, c_cap, c_zero, packed_ptr, scales_ptr, n_blocks,
    BLOCKS: tl.constexpr, W: tl.constexpr, FAST: tl.constexpr, STEPS: tl.constexpr,
    PAIRS: tl.constexpr,
):  # fmt: skip
    raw0, raw1 = x0, x1
    x0 = _to_float(x0, PAIRS)
    x1 = _to_float(x1, PAIRS)
    amax = tl.maximum(tl.max(_abs(x0), axis=1), tl.max(_abs(x1), axis=1))
    if W == 4:
        x2 = x2.to(tl.float32)
        x3 = x3.to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=1))
        amax = tl.maximum(amax, tl.max(tl.abs(x3), axis=1))
    s_rounded, s_byte = _round_e4m3(_block_scale(amax, c, y_c, c_cap, c_zero, FAST, STEPS))
    d = s_rounded * s2  # the per-block divisor, rounded once as in the reference
    y = d
    neg_bound = d.to(tl.int32, bitcast=True)
    if FAST:
        y = _reciprocal(d)
        neg_bound = _negative_bound(d)
    if PAIRS and FAST:
        # the signs of a half's eight elements come together from its words (_sign_bits)
        word0 = _word(_codes(x0, d, y, neg_bound, FAST, STEPS, SIGNED=False), W)
        word1 = _word(_codes(x1, d, y, neg_bound, FAST, STEPS, SIGNED=False), W)
        word0 = _sign_bits(raw0, neg_bound, word0)
        word1 = _sign_bits(raw1, neg_bound, word1)
    else:
        word0 = _word(_codes(x0, d, y, neg_bound, FAST, STEPS), W)
        word1 = _word(_codes(x1, d, y, neg_bound, FAST, STEPS), W)
    if W == 4:
        word0 = word0 | (word1 << 16)
        word1 = _word(_codes(x2, d, y, neg_bound, FAST, STEPS), W)
        word1 = word1 | (_word(_codes(x3, d, y, neg_bound, FAST, STEPS), W) << 16)
    blocks = tile.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < n_blocks
    words = tl.join(word0, word1)  # [BLOCKS, 2]: the block's 8 bytes
    tl.store(
        packed_ptr + blocks[:, None] * 2 + tl.arange(0, 2)[None, :], words, mask=in_range[:, None]
    )
    # One byte a block, each stored from the thread that owns the block: said to be
    # contiguous, the bytes would be regrouped through shared memory first (two barriers).
    tl.store(scales_ptr + tl.max_contiguous(blocks, 1), s_byte.to(tl.uint8), mask=in_range)


@triton.jit
def quantize_kernel(
    x_ptr,  # the n_blocks * 16 elements, contiguous: fp16, fp32, or bf16 as int32 pairs
    packed_ptr,  # [n_blocks * 2] int32 (the packed bytes, 4 per word)
    scales_ptr,  # [n_blocks] uint8 (the bytes of float8_e4m3fn)
    s2_ptr,  # 0-d fp32: decode-form global scale
    n_blocks,
    BLOCKS: tl.constexpr,  # blocks of 16 per tile: one per thread
    W: tl.constexpr,  # elements per 16 bytes of x: 8 (bf16, fp16) or 4 (fp32)
    STEPS: tl.constexpr,  # Markstein steps: 1 for 16-bit inputs, 2 for fp32
    PAIRS: tl.constexpr,  # bf16 passed as int32 words of two elements (see _to_float)
    FAST_S2_MIN: tl.constexpr,
    FAST_S2_MAX: tl.constexpr,
):
    """Tiles pid, pid + programs, ...; each loaded one iteration ahead of its encoding."""
    n_tiles = tl.cdiv(n_blocks, BLOCKS)
    programs = tl.num_programs(0)
    s2 = tl.load(s2_ptr)
    fast = (s2 >= FAST_S2_MIN) & (s2 <= FAST_S2_MAX)
    c = 6.0 * s2  # the reference rounds this product first
    y_c = tl.div_rn(1.0, c)  # _block_scale's constants, once a program
    c_cap = c * 1048576.0  # 2^20
    c_zero = c * 2.0**-46
    tile = tl.program_id(0)
    x0, x1, x2, x3 = _load_tile(x_ptr, tile, n_blocks, BLOCKS, W, PAIRS)
    while tile < n_tiles:
        n0, n1, n2, n3 = _load_tile(x_ptr, tile + programs, n_blocks, BLOCKS, W, PAIRS)
        if fast:
            _quantize_tile(x0, x1, x2, x3, tile, s2, c, y_c, c_cap, c_zero, packed_ptr,
                           scales_ptr, n_blocks, BLOCKS, W, True, STEPS, PAIRS)  # fmt: skip
        else:
            _quantize_tile(x0, x1, x2, x3, tile, s2, c, y_c, c_cap, c_zero, packed_ptr,
                           scales_ptr, n_blocks, BLOCKS, W, False, STEPS, PAIRS)  # fmt: skip
        x0, x1, x2, x3 = n0, n1, n2, n3
        tile += programs
