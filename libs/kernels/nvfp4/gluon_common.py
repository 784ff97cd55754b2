"""The Gluon pieces the Gluon kernels share: the e4m3 scale conversion and the word decode
(PTX), splitting a register into its two 16-bit halves, a word's block scale, the
epilogue's s2 and bias, and the weight words' loads with an L2 prefetch size.

The decode is the one common.py describes, on whole int32 words so a word is never split
into bytes. Each kernel imports what it uses from here, none from another kernel.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .common import DECODE_BITS_BF16, DECODE_BITS_F16

# PTX: an int16 holding two e4m3 block scales -> the two scales as packed 16-bit floats,
# pre-multiplied by 2^SCALE_LOG2 (exact: e4m3 has 3 mantissa bits). Hopper converts e4m3
# pairs to f16 pairs in one instruction.
SCALE_ASM_BF16 = gl.constexpr("""
{
.reg .b32 h;
.reg .b16 l, u;
.reg .f32 a, b;
cvt.rn.f16x2.e4m3x2 h, $1;
mov.b32 {l, u}, h;
cvt.f32.f16 a, l;
cvt.f32.f16 b, u;
mul.f32 a, a, 0f7A000000;
mul.f32 b, b, 0f7A000000;
cvt.rn.bf16x2.f32 $0, b, a;
}
""")  # 0f7A000000 = 2^117
SCALE_ASM_F16 = gl.constexpr("""
{
.reg .b32 h, c;
mov.b32 c, 0x58005800;
cvt.rn.f16x2.e4m3x2 h, $1;
mul.rn.f16x2 $0, h, c;
}
""")  # 0x5800 = 2^7 in f16


def word_asm(prmts: tuple[tuple[str, str, str], ...], bits: dict) -> str:
    """PTX: one int32 word $4 of 4 bytes b0..b3 and its block scale $5 (16-bit,
    pre-multiplied) -> four packed 16-bit pairs $0..$3, each weight times the scale:
    triton_kernel's decode (same instructions, same values) on a whole word, so the word
    never has to be split into bytes. Pair i comes from `prmt.b32 p, a, b, selector` with
    prmts[i] = (a, b, selector): sources "w4" (the word shifted left by 4: low nibbles in
    each byte's top half), "$4" (the word) or "z" (zero); then one shift, one mask and one
    multiply. The selectors choose which nibbles pair up."""
    uses_z = any("z" in (a, b) for a, b, _ in prmts)
    lines = [".reg .b32 z, w4, p, s;" if uses_z else ".reg .b32 w4, p, s;"]
    lines += ["mov.b32 z, 0;"] if uses_z else []
    lines += ["mov.b32 s, {$5, $5};", "shl.b32 w4, $4, 4;"]
    for i, (a, b, sel) in enumerate(prmts):
        lines += [f"prmt.b32 p, {a}, {b}, {sel};", f"shl.b32 p, p, {bits['sh']};",
                  f"and.b32 p, p, {bits['mask']};", f"mul.rn.{bits['ty']}x2 ${i}, p, s;"]
    return "\n{\n" + "\n".join(lines) + "\n}\n"


# The word decode with the word shifted left by 4 (w4) and the word itself as prmt's two
# sources, so each output register pairs byte j's low nibble (from w4) with its high nibble
# (from the word): (lo b0, hi b0), (lo b1, hi b1), .. are consecutive K, so x's pairs are
# its memory pairs and need no re-pairing.
NATURAL_PRMTS = (("w4", "$4", "0xC480"), ("w4", "$4", "0xD591"), ("w4", "$4", "0xE6A2"),
                 ("w4", "$4", "0xF7B3"))
NATURAL_ASM_BF16 = gl.constexpr(word_asm(NATURAL_PRMTS, DECODE_BITS_BF16))
NATURAL_ASM_F16 = gl.constexpr(word_asm(NATURAL_PRMTS, DECODE_BITS_F16))


@gluon.jit
def halves(pair, dtype: gl.constexpr):
    """int32 [...] holding two 16-bit floats -> dtype [..., 2] (low half first)."""
    lo = pair.to(gl.int16)
    hi = (pair >> 16).to(gl.int16)
    return gl.join(lo, hi).to(dtype, bitcast=True)


@gluon.jit
def word_scales(sp, NW: gl.constexpr, dtype: gl.constexpr, WL: gl.constexpr):
    """int16 scale pairs [BN, NW / 4] (two blocks' e4m3 bytes) -> each int32 word's block
    scale [BN, NW] in dtype, pre-multiplied (SCALE_ASM_*), in the words' layout WL."""
    BN: gl.constexpr = sp.shape[0]
    if dtype == gl.bfloat16:
        scale_asm: gl.constexpr = SCALE_ASM_BF16
    else:
        scale_asm: gl.constexpr = SCALE_ASM_F16
    pairs = gl.inline_asm_elementwise(scale_asm, "=r,h", [sp], dtype=gl.int32, is_pure=True,
                                      pack=1)
    scale = gl.reshape(halves(pairs, dtype), [BN, NW // 2])  # per 16-weight block
    scale = gl.reshape(gl.join(scale, scale), [BN, NW])  # per word
    return gl.convert_layout(scale, WL, assert_trivial=True)


@gluon.jit
def load_s2_bias(s2_ptr, bias_ptr, rows, N, HAS_BIAS: gl.constexpr):
    """The epilogue's global operands: s2, and the bias of `rows` in fp32 (without a bias,
    s2 stands in for it and is never read as one)."""
    s2 = gl.load(s2_ptr)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
    else:
        bias = s2
    return s2, bias


# The word loads' L2 prefetch size: L2 then brings each row's 128-byte line whole from
# DRAM, two chunks of that row. Outputs are bit-equal with or without it; 64 and 256 bytes
# do about as well.
L2_PREFETCH = 128


def words_load_asm(pf: int, per: int, l1: str = "") -> str:
    """The PTX of one thread's `per` consecutive words of a row (1, 2 or 4 registers:
    pack=per; one vector load, so their address is aligned to 4 per bytes), with the L1
    hint l1 and L2 prefetching the aligned pf bytes around them from DRAM (the row's next
    chunks); "" for gl.load without that (pf 0). Callers issue it volatile, so the loads
    stay where they are written."""
    if pf == 0:
        return ""
    regs = ", ".join(f"${i}" for i in range(per))
    vec = "" if per == 1 else f".v{per}"
    return f"ld.global{l1}.L2::{pf}B{vec}.b32 {{{regs}}}, [${per}];"
