"""The GEMM's register-level work (gemm_kernel.py): one step of a weight slot read from
shared memory, its block scales converted, its weights decoded straight into wgmma's
A-operand registers; and the layouts that make each of those a no-op to move.

Why a module of its own: this is where the bits are (the PTX and the register layouts
that make the decode land where wgmma reads it), apart from the kernel's pipeline (rings,
barriers, partitions) in gemm_kernel.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .common import DECODE_BITS_BF16, DECODE_BITS_F16
from .gluon_common import SCALE_ASM_BF16, SCALE_ASM_F16, halves, word_scales

# PTX: one int32 word (bytes b0..b3), this thread's byte selector ($2 = 0xC480 + 0x1111 t
# picks byte t) and its 16-bit block scale -> byte t's two weights (low nibble, high
# nibble: K order) as packed 16-bit floats times the scale. The arithmetic of
# triton_kernel's decode: prmt puts the nibble in place with its sign bit replicated
# above, shl and and keep sign, exponent and mantissa bits, the multiply rescales.
_BYTE_ASM = """
{{
.reg .b32 w4, p, s;
mov.b32 s, {{$3, $3}};
shl.b32 w4, $1, 4;
prmt.b32 p, w4, $1, $2;
shl.b32 p, p, {sh};
and.b32 p, p, {mask};
mul.rn.{ty}x2 $0, p, s;
}}
"""
_BYTE_ASM_BF16 = gl.constexpr(_BYTE_ASM.format(**DECODE_BITS_BF16))
_BYTE_ASM_F16 = gl.constexpr(_BYTE_ASM.format(**DECODE_BITS_F16))


# PTX: a quad's four 16-bit scale pairs, packed two to a register in $4 and $5 (the same
# in all four threads) -> all four converted ($0..$3): thread t converts pair t (prmt's
# selector 0x10 + 0x22 t picks its two bytes) with gluon_common's SCALE_ASM_* arithmetic
# and reads the others' results by shuffle.
_SHARE_ASM = """
{{
.reg .b32 lane, t, base, src, sel, w, v;
.reg .b16 own;
mov.u32 lane, %laneid;
and.b32 t, lane, 3;
sub.u32 base, lane, t;
mad.lo.u32 sel, t, 0x22, 0x10;
prmt.b32 w, $4, $5, sel;
cvt.u16.u32 own, w;
{convert}
shfl.sync.idx.b32 $0, v, base, 0x1f, 0xffffffff;
add.u32 src, base, 1;
shfl.sync.idx.b32 $1, v, src, 0x1f, 0xffffffff;
add.u32 src, base, 2;
shfl.sync.idx.b32 $2, v, src, 0x1f, 0xffffffff;
add.u32 src, base, 3;
shfl.sync.idx.b32 $3, v, src, 0x1f, 0xffffffff;
}}
"""


def _share(scale_asm: gl.constexpr) -> gl.constexpr:
    """_SHARE_ASM around one of gluon_common's conversions ($1 -> $0 there)."""
    return gl.constexpr(_SHARE_ASM.format(
        convert=scale_asm.value.replace("$1", "own").replace("$0", "v")))


_SHARE_ASM_BF16 = _share(SCALE_ASM_BF16)
_SHARE_ASM_F16 = _share(SCALE_ASM_F16)


@gluon.jit
def read_step(w_slot, s_slot, j: gl.constexpr, dtype: gl.constexpr, SHARE: gl.constexpr,
               L3: gl.constexpr, L3P: gl.constexpr):
    """Step j of a weight slot: its words [BN, NW] and each word's block scale [BN, NW] in
    dtype, pre-multiplied, both in the words' layout (a slice of L3).

    The four threads of a quad hold the same two rows' four scale pairs. With SHARE each
    converts one (six instructions a pair in bf16) and warp shuffles hand the results
    round; without, each converts all four (gluon_common.word_scales), which is faster
    where two programs share an SM."""
    NW: gl.constexpr = L3.shape[2]
    NP: gl.constexpr = L3P.shape[2]
    words = w_slot.slice(j * NW, NW, dim=1).load(gl.SliceLayout(1, L3))
    pairs = s_slot.slice(j * NP, NP, dim=1).load(gl.SliceLayout(1, L3P))
    if not SHARE:
        return words, word_scales(pairs, NW, dtype, gl.SliceLayout(1, L3))
    if dtype == gl.bfloat16:
        share_asm: gl.constexpr = _SHARE_ASM_BF16
    else:
        share_asm: gl.constexpr = _SHARE_ASM_F16
    conv = gl.inline_asm_elementwise(share_asm, "=r,=r,=r,=r,r,r", [pairs],
                                     dtype=gl.int32, is_pure=True, pack=4)
    scale = gl.reshape(halves(conv, dtype), [words.shape[0], NW // 2])  # per block
    scale = gl.reshape(gl.join(scale, scale), [words.shape[0], NW])  # per word
    return words, gl.convert_layout(scale, gl.SliceLayout(1, L3), assert_trivial=True)


@gluon.jit
def decode_fragment(words, sc, dtype: gl.constexpr, L3: gl.constexpr, A_L: gl.constexpr):
    """One step's weights straight into wgmma's A-operand registers (layout A_L).

    words [BN, NW] int32 and each word's block scale sc [BN, NW] (read_step) arrive in
    a slice of a [BN, 4, NW] layout whose dim 1 is the quad lane t: every thread of a quad
    holds its two rows' whole step. Thread t decodes byte t of each word: bytes t and t + 4
    of a 16-weight block are the K pairs (2t, 2t + 1) and (2t + 8, 2t + 9) that wgmma's A
    fragment (like mma.sync's) gives that thread, so nothing moves between threads (the
    last convert_layout is checked to be free at compile time)."""
    BN: gl.constexpr = words.shape[0]
    NW: gl.constexpr = words.shape[1]
    if dtype == gl.bfloat16:
        byte_asm: gl.constexpr = _BYTE_ASM_BF16
    else:
        byte_asm: gl.constexpr = _BYTE_ASM_F16
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    sc3, t3 = gl.broadcast(gl.expand_dims(sc.to(gl.int16, bitcast=True), 1), t)
    w3, _ = gl.broadcast(gl.expand_dims(words, 1), t)
    p = gl.inline_asm_elementwise(byte_asm, "=r,r,r,h", [w3, 0xC480 + 0x1111 * t3, sc3],
                                  dtype=gl.int32, is_pure=True, pack=1)
    w = gl.permute(halves(p, dtype), (0, 2, 1, 3))  # [row, word, t, e]: K = 8 word + 2t + e
    return gl.convert_layout(gl.reshape(w, [BN, 8 * NW]), A_L, assert_trivial=True)


@gluon.constexpr_function
def acc_layout(bm):
    """An MMA warpgroup's accumulator [64 rows, bm tokens]."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, bm, 16])


@gluon.constexpr_function
def quads(n):
    """A step's words [64, 4, n] (n = BK / 8) or scale pairs (n = BK / 32) for an MMA
    warpgroup: dim 1 is the quad lane t (the data are the same for all four), rows placed
    as in wgmma's A fragment: g and g + 8 of each warp's 16."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(n.bit_length() - 1)] + [[8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, n])
