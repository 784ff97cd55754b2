"""The quantize kernel's per-block steps against plain IEEE operations, over whole ranges.

quantize_kernel.py computes each block's scale, divisor, reciprocal and sign bound with
short PTX forms (a hardware e4m3 conversion, a reciprocal without its slow path, a product
rounded toward zero, a division-free quotient). The bit-exact quantize tests reach only
the values their inputs produce; these run every input each step can get:
- the e4m3 rounding: every fp32 in [2^-9, 448] against torch's cast;
- the reciprocal and the sign bound: every fp32 divisor in [2^-89, 2^89] against a
  correctly rounded division and the sign bound's integer form (its definition);
- the bf16 signs: every finite bf16 against every sign bound a quantize can make;
- the block scale: millions of (amax, s2) pairs, with the edges of the fast s2 range, of
  the clamps and of the quotients that round to zero, against a correctly rounded division.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from libs.kernels.nvfp4 import quantize_kernel as qk

    @triton.jit
    def _e4m3_kernel(s_ptr, rounded_ptr, byte_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(s_ptr + i, mask=i < n, other=1.0)
        rounded, byte = qk._round_e4m3(s)
        tl.store(rounded_ptr + i, rounded, mask=i < n)
        tl.store(byte_ptr + i, byte.to(tl.uint8), mask=i < n)

    @triton.jit
    def _divisor_steps_kernel(first_bits, n, bad_ptr, BARE: tl.constexpr, BLOCK: tl.constexpr):
        """Counts, for d = every fp32 from first_bits on, the reciprocals that differ from a
        correctly rounded 1 / d and the sign bounds that differ from the integer form.
        BARE: the hardware's approximation alone, which must be caught."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        d = (first_bits + i).to(tl.int32).to(tl.float32, bitcast=True)
        if BARE:
            y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            y = qk._reciprocal(d)
        y_bad = (y.to(tl.int32, bitcast=True)
                 != tl.div_rn(1.0, d).to(tl.int32, bitcast=True)) & (i < n)
        # the integer form: floor(d / 2) steps of 2^-149 below d = 2^24, else exponent - 150
        old = tl.where(d < 16777216.0, (d * 0.5).to(tl.int32),
                       d.to(tl.int32, bitcast=True) - (150 << 23))
        nb_bad = (qk._negative_bound(d) != (old | -0x80000000)) & (i < n)
        tl.atomic_add(bad_ptr, tl.sum(y_bad.to(tl.int32)))
        tl.atomic_add(bad_ptr + 1, tl.sum(nb_bad.to(tl.int32)))

    @triton.jit
    def _block_scale_kernel(amax_ptr, s2_ptr, fast_ptr, exact_ptr, n, STEPS: tl.constexpr,
                            BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        amax = tl.load(amax_ptr + i, mask=i < n, other=0.0)
        s2 = tl.load(s2_ptr + i, mask=i < n, other=1.0)
        c = 6.0 * s2
        fast = qk._block_scale(amax, c, tl.div_rn(1.0, c), c * 1048576.0, c * 2.0**-46,
                               True, STEPS)
        exact = qk._block_scale(amax, c, c, c, c, False, STEPS)
        tl.store(fast_ptr + i, fast, mask=i < n)
        tl.store(exact_ptr + i, exact, mask=i < n)

    @triton.jit
    def _sign_bits_kernel(words_ptr, bounds_ptr, out_ptr, n_rows, ROWS: tl.constexpr):
        """Rows of `words` ([n_rows, 4] int32 bf16 pairs) against bound program_id(0)."""
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        words = tl.load(words_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :])
        bound = tl.load(bounds_ptr + tl.program_id(0) + rows * 0)
        signs = qk._sign_bits(words, bound, rows * 0)
        tl.store(out_ptr + tl.program_id(0) * n_rows + rows, signs)


def f32_bits(value: float) -> int:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32).item()


def test_e4m3_rounding_is_torchs_cast_on_every_fp32_in_range():
    first, last = f32_bits(2.0**-9), f32_bits(448.0)
    s = torch.arange(first, last + 1, device="cuda", dtype=torch.int32).view(torch.float32)
    rounded = torch.empty_like(s)
    byte = torch.empty(s.shape, device="cuda", dtype=torch.uint8)
    _e4m3_kernel[(triton.cdiv(s.numel(), 1024),)](s, rounded, byte, s.numel(), BLOCK=1024)
    want = s.to(torch.float8_e4m3fn)  # nearest even; in this range nothing saturates
    assert torch.equal(byte, want.view(torch.uint8)), (byte != want.view(torch.uint8)).sum()
    assert torch.equal(rounded, want.float())
    # the range has subnormal scales, ties and the top value, so both forms were exercised
    assert byte.min().item() == 0x01 and byte.max().item() == 0x7E


def count_divisor_mismatches(first: float, last: float, bare: bool = False) -> list[int]:
    first_bits, last_bits = f32_bits(first), f32_bits(last)
    bad = torch.zeros(2, device="cuda", dtype=torch.int32)
    chunk = 1 << 28
    for start in range(first_bits, last_bits + 1, chunk):
        n = min(chunk, last_bits + 1 - start)
        _divisor_steps_kernel[(triton.cdiv(n, 4096),)](start, n, bad, BARE=bare, BLOCK=4096)
    return bad.tolist()


def test_reciprocal_and_sign_bound_on_every_divisor_of_the_fast_range():
    assert count_divisor_mismatches(2.0**-89, 2.0**89) == [0, 0]


def test_the_harness_sees_a_wrong_reciprocal():
    # The hardware's approximation without the Newton step is off by an ulp now and then.
    bad_reciprocals, _ = count_divisor_mismatches(1.0, 2.0, bare=True)
    assert bad_reciprocals > 1000


def test_sign_bits_are_the_unsigned_compare_for_every_bf16_and_bound():
    # Every finite bf16 (NaN patterns never reach the kernel: quantize rejects them)
    # against every bound's top half a quantize can make (d * 2^-150 rounded down, d up to
    # 2^89, with the sign bit: 0x8000 to 0xA1FF), with random low halves.
    x16 = torch.arange(65536, device="cuda", dtype=torch.int64)
    nan = ((x16 & 0x7F80) == 0x7F80) & ((x16 & 0x7F) != 0)
    x16 = torch.where(nan, 0, x16)
    words = (x16[0::2] | (x16[1::2] << 16)).to(torch.int32).view(-1, 4)  # [8192, 4]
    g = torch.Generator(device="cuda").manual_seed(3)
    top = torch.arange(0x8000, 0xA200, device="cuda", dtype=torch.int64)
    low = torch.randint(0, 65536, top.shape, device="cuda", generator=g)
    low[:16] = 0
    low[16:32] = 0xFFFF
    bounds = (top << 16) | low
    out = torch.empty(len(bounds), 8192, device="cuda", dtype=torch.int32)
    _sign_bits_kernel[(len(bounds), 8192 // 256)](words, bounds.to(torch.int32), out, 8192,
                                                  ROWS=256)
    # the integer form _add_sign uses: element bits (x16 << 16) > bound, as unsigned
    negative = (x16[None, :] << 16) > bounds[:, None]  # [bounds, 65536], both non-negative
    nibble_sign = 8 << (4 * torch.arange(8, device="cuda"))
    want = (negative.view(len(bounds), 8192, 8).long() * nibble_sign).sum(-1)
    assert torch.equal(out.long() & 0xFFFFFFFF, want), "sign bits differ"
    assert negative.any() and not negative.all()


def _amax_values(dtype: torch.dtype, count: int, g: torch.Generator) -> torch.Tensor:
    """Positive values of `dtype` spread over its whole exponent range, plus zero."""
    info = torch.finfo(dtype)
    lo = torch.log2(torch.tensor(info.smallest_normal)).item() - 10  # subnormals too
    hi = torch.log2(torch.tensor(info.max)).item()
    v = (2.0 ** torch.empty(count).uniform_(lo, hi, generator=g)).to(dtype).float()
    v[:16] = 0.0
    return v


def _s2_for_quotients(amax: torch.Tensor, log2_q: torch.Tensor) -> torch.Tensor:
    """s2 such that amax / (6 * s2) is near 2^log2_q, kept in the fast range."""
    return (amax / (6 * 2.0**log2_q)).clamp(2.0**-80, 2.0**80)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_scale_without_division_equals_the_division(dtype):
    g = torch.Generator().manual_seed(11)
    count = 1 << 21
    # anywhere: mostly clamped quotients, every exponent of amax and s2
    amax = _amax_values(dtype, count, g)
    s2 = 2.0 ** torch.empty(count).uniform_(-80, 80, generator=g)
    # quotients between the clamps, where the e4m3 rounding will see every bit
    mid = _amax_values(dtype, count, g)[16:].clamp_min(torch.finfo(dtype).tiny)
    mid_s2 = _s2_for_quotients(mid, torch.empty(len(mid)).uniform_(-10, 10, generator=g))
    # quotients at the clamps, at 2^-150 (rounding to zero or not), at the cap
    q = 2.0 ** torch.tensor([-150.0, -149.5, -149.0, -126.0, -9.0, 8.807, 20.0, 21.0, 100.0])
    q = torch.cat([q, torch.nextafter(q, q * 2), torch.nextafter(q, q / 2)])
    edge_s2 = 2.0 ** torch.empty(len(q) * 64).uniform_(-80, 80, generator=g)
    edge_amax = (q.repeat(64) * 6 * edge_s2).to(dtype).float()
    keep = torch.isfinite(edge_amax)  # the kernel never sees inf: quantize rejects it
    tail = torch.tensor([2.0**-149, torch.finfo(dtype).max])
    amax = torch.cat([amax, mid, edge_amax[keep], tail])
    s2 = torch.cat([s2, mid_s2, edge_s2[keep], torch.tensor([2.0**80, 2.0**-80])])
    amax = amax.to(dtype).float()  # the last two, and mid's clamp, as values of dtype
    amax, s2 = amax.cuda(), s2.cuda()
    fast, exact = torch.empty_like(amax), torch.empty_like(amax)
    steps = 2 if dtype == torch.float32 else 1
    _block_scale_kernel[(triton.cdiv(amax.numel(), 1024),)](
        amax, s2, fast, exact, amax.numel(), STEPS=steps, BLOCK=1024)
    differ = fast.view(torch.int32) != exact.view(torch.int32)
    assert not differ.any(), (amax[differ][:5].tolist(), s2[differ][:5].tolist())
    # all three outcomes were reached: zero blocks (1.0), both clamps, and values between
    assert (exact == 1.0).any() and (exact == 2.0**-9).any() and (exact == 448.0).any()
    assert ((exact > 2.0**-9) & (exact < 448.0) & (exact != 1.0)).sum() > count // 2
