"""The Triton (CUDA) path of the NVFP4 kernels against the torch reference.

quantize and dequantize must be BIT-exact with reference.py run on the CPU (the reference
is bit-exact with ModelOpt): packed bytes, scale bytes, s2 and every output bit (-0.0
included). The linear is compared with a tolerance (see test_linear_matches_reference).
"""

import importlib.util

import pytest
import torch

from libs.kernels import dequantize_nvfp4, nvfp4_linear, quantize_nvfp4
from libs.kernels.nvfp4 import reference

from .nvfp4_helpers import MIDPOINTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CUDA = "cuda"


@pytest.fixture(autouse=True)
def _uses_triton():
    from libs.kernels.nvfp4 import _impl, triton_impl

    assert _impl(torch.empty(1, device=CUDA)) is triton_impl


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != 0.0 and every NaN payload is compared too."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_quantize_matches_reference(x: torch.Tensor, global_scale=None):
    """Quantize on the GPU through the public API and compare with the CPU reference."""
    packed, scales, s2 = quantize_nvfp4(x.to(CUDA), global_scale)
    x_cpu = x.cpu()
    s2_ref = (
        reference.global_scale(x_cpu)
        if global_scale is None
        else torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    )
    p_ref, s_ref = reference.quantize(x_cpu, s2_ref)
    assert bits(s2.cpu()).item() == bits(s2_ref).item()
    assert torch.equal(bits(scales.cpu()), bits(s_ref)), "scale bytes differ"
    assert torch.equal(packed.cpu(), p_ref), f"{(packed.cpu() != p_ref).sum()} packed bytes differ"
    return packed, scales, s2


def random_input(shape, dtype, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if kind == "wide":  # rows spanning 1e-6..1e3: small, large and clamped block scales
        x = x * 10 ** torch.empty(*shape[:-1], 1).uniform_(-6, 3, generator=g)
    elif kind == "heavy":  # heavy tails: a few elements dominate their blocks
        x = x**3
    elif kind == "blocks":  # per-block magnitudes over 30 decades, some all-zero blocks
        b = x.unflatten(-1, (-1, 16))
        b *= 10 ** torch.empty(*b.shape[:-1], 1).uniform_(-20, 10, generator=g)
        b *= (torch.rand(*b.shape[:-1], 1, generator=g) > 0.1).float()
        x = b.flatten(-2)
    if dtype is torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


SHAPES = [(1, 16), (3, 5, 48), (7, 4096), (33, 8192), (2, 16400), (129, 576), (1, 8208)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "wide", "heavy", "blocks"])
def test_quantize_bit_exact(shape, dtype, kind):
    seed = sum(shape) * 10 + ["normal", "wide", "heavy", "blocks"].index(kind)
    x = random_input(shape, dtype, kind, seed)
    assert_quantize_matches_reference(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_bit_exact_large(dtype):
    x = random_input((1024, 8192), dtype, "wide", seed=7)
    assert_quantize_matches_reference(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("global_scale", [1.0, 1e-3, 0.125, 3e-30, 1e-40, 1e30])
def test_quantize_bit_exact_with_given_global_scale(dtype, global_scale):
    # Tiny and huge s2 drive per-block scales to the clamps, elements far past 6 (saturation),
    # and (1e-40) the per-block product fp32(s_b) * s2 to zero: x / 0 is inf or NaN, and the
    # reference's codes for those must be reproduced too.
    x = random_input((16, 256), dtype, "blocks", seed=3)
    assert_quantize_matches_reference(x, global_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_ties_and_near_ties(dtype):
    # Every E2M1 midpoint times an exact power-of-two scale, and its fp32 neighbours (the
    # neighbours survive only in fp32; in bf16/fp16 they round back onto the tie or next to it).
    mids = torch.tensor(MIDPOINTS)
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    g = torch.Generator().manual_seed(5)
    rows = []
    for e in range(-8, 9):
        vals = near[torch.randint(0, len(near), (15,), generator=g)]
        vals = vals * torch.where(torch.rand(15, generator=g) < 0.5, -1.0, 1.0)
        rows.append(torch.cat([vals, torch.tensor([6.0])]) * 2.0**e)
    x = torch.stack(rows).to(dtype)
    assert_quantize_matches_reference(x, global_scale=2.0**-3)
    assert_quantize_matches_reference(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_near_every_decision_point(dtype):
    # The CUDA kernel decides codes by comparing |x| with per-block thresholds instead of
    # dividing; these inputs sit within a few ulps of every midpoint times many per-block
    # divisors d, where a threshold off by one ulp would show.
    g = torch.Generator().manual_seed(17)
    anchors = torch.empty(96).uniform_(0.01, 2000.0, generator=g)
    anchors[:8] = torch.tensor([6.0, 12.0, 3.0, 0.75, 1e-3, 1e-5, 448 * 6, 1.5])
    s_b = (anchors / 6).clamp(2.0**-9, 448).to(torch.float8_e4m3fn).float()  # s2 = 1
    blocks = []
    for a, d in zip(anchors.tolist(), s_b.tolist(), strict=True):
        vals = []
        for m in MIDPOINTS:
            v = torch.tensor(m * d, dtype=torch.float32)
            for _ in range(3):
                v = torch.nextafter(v, torch.tensor(0.0))
            for _ in range(7):
                vals.append(v.item())
                v = torch.nextafter(v, torch.tensor(1e30))
        vals = torch.tensor(vals)
        vals = vals * torch.where(torch.rand(len(vals), generator=g) < 0.5, -1.0, 1.0)
        vals = torch.cat([vals, torch.zeros(60 - len(vals))]).reshape(4, 15)
        blocks.append(torch.cat([vals, torch.full((4, 1), a)], dim=1))
    x = torch.cat(blocks).reshape(-1, 64).to(dtype)
    assert_quantize_matches_reference(x, global_scale=1.0)
    assert_quantize_matches_reference(x, global_scale=0.37)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_subnormal_and_signed_zero_inputs(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 4, -tiny / 4, 1e-30, -1e-30] * 4)
    x = x.reshape(2, 16).to(dtype)
    for gs in (None, 1.0, 1e-38, 1e-44):
        assert_quantize_matches_reference(x, gs)


# The kernel's division-free path runs for s2 in [2^-80, 2^80]; outside, every element is
# divided. These s2 sit on both sides of each edge.
FAST_PATH_EDGES = [2.0**-80, 2.0**-80 * 0.99, 2.0**80, 2.0**80 * 1.01]


def _neighbours(value: float, dtype: torch.dtype, count: int = 3) -> torch.Tensor:
    """`value` rounded to `dtype` and its `count` nearest representable values either side
    (positive values only: adjacent bit patterns are adjacent values)."""
    int_type = {2: torch.int16, 4: torch.int32}[torch.finfo(dtype).bits // 8]
    centre = torch.tensor(value, dtype=torch.float64).to(dtype).view(int_type).item()
    steps = torch.arange(centre - count, centre + count + 1).clamp(min=0).to(int_type)
    return steps.view(dtype)


@pytest.mark.parametrize(
    ("dtype", "s2"),
    [
        (torch.float32, 1.0),
        (torch.float32, 0.37),
        (torch.float32, 2.0**70),
        (torch.bfloat16, 2.0**10),
    ],
    ids=["fp32-s2=1", "fp32-s2=0.37", "fp32-s2=2^70", "bf16-s2=2^10"],
)
def test_quantize_sign_of_quotients_that_underflow(dtype, s2):
    # A negative x whose quotient x / d rounds to -0.0 gets code 0x0, one that stays below
    # zero gets 0x8: the boundary is x = -d * 2^-150 (a tie, which rounds to -0.0). The
    # kernel decides it with an exact compare rather than the quotient; these elements sit
    # on the representable values nearest that boundary for many per-block divisors d.
    g = torch.Generator().manual_seed(23)
    s_b = torch.empty(64).uniform_(1.0, 448.0, generator=g)
    s_b[:4] = torch.tensor([2.0, 1.875, 448.0, 64.0])  # d = 2 puts the tie on the fp32 grid
    anchors = (6 * s_b * s2).to(dtype).float()
    alone = torch.zeros(len(anchors), 16)
    alone[:, -1] = anchors  # each row's block scale is set by its anchor alone
    d = reference.block_scales(alone, torch.tensor(s2)).float()[:, 0] * s2
    rows = []
    for anchor, divisor in zip(anchors.tolist(), d.tolist(), strict=True):
        near = _neighbours(divisor * 2.0**-150, dtype).float()
        row = torch.cat([-near, near[:1], -near[:1]])
        pad = torch.full((15 - len(row),), -near[-1].item())
        rows.append(torch.cat([row, pad, torch.tensor([anchor])]))
    x = torch.stack(rows).to(dtype)
    packed, _, _ = assert_quantize_matches_reference(x, s2)
    codes = reference.unpack(packed.cpu())
    assert (codes == 8).any() and (codes == 0).any(), "the boundary was not straddled"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s2", FAST_PATH_EDGES, ids=["2^-80", "below", "2^80", "above"])
def test_quantize_at_the_edges_of_the_division_free_range(dtype, s2):
    # Near 2^-80 with fp32 inputs up to 3e38 the quotients overflow fp32 (inf, or NaN from
    # inf - inf inside the correction step): they must saturate to 6 like the true quotient.
    # Near 2^80 every block scale is clamped to 2^-9 and most quotients round to 0.
    x = random_input((32, 256), dtype, "blocks", seed=29)
    big = torch.finfo(dtype).max
    x[0, :16] = torch.tensor([big, -big, big / 3, 1.0, -1.0, 0.0, -0.0, 2.0**-100] * 2).to(dtype)
    assert_quantize_matches_reference(x, s2)
    assert_quantize_matches_reference(x * 1e-3, s2)


def test_quantize_all_zero_and_empty():
    assert_quantize_matches_reference(torch.zeros(3, 48, dtype=torch.bfloat16))
    packed, scales, s2 = quantize_nvfp4(torch.empty(0, 32, device=CUDA))
    assert packed.shape == (0, 16) and scales.shape == (0, 2) and s2.item() == 1.0


def test_quantize_bf16_at_an_address_not_4_byte_aligned():
    # bf16 is read as int32 words of two elements: a contiguous CUDA view that starts at an
    # odd element (2 bytes past a word) must still quantize exactly.
    flat = random_input((1, 16 * 40 + 1), torch.bfloat16, "wide", seed=41).flatten()
    x = flat.to(CUDA)[1:].view(40, 16)
    assert x.is_contiguous() and x.data_ptr() % 4 == 2
    packed, scales, s2 = quantize_nvfp4(x)
    p_ref, s_ref = reference.quantize(flat[1:].view(40, 16), s2.cpu())
    assert torch.equal(packed.cpu(), p_ref)
    assert torch.equal(bits(scales.cpu()), bits(s_ref))


def test_quantize_non_contiguous_input():
    x = torch.randn(64, 48, device=CUDA).T  # [48, 64], K strided
    p1, s1, _ = quantize_nvfp4(x)
    p2, s2, _ = quantize_nvfp4(x.contiguous())
    assert torch.equal(p1, p2) and torch.equal(bits(s1), bits(s2))
    assert_quantize_matches_reference(x.cpu().clone())


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (5, 3, 64), (300, 4096), (7, 8208)], ids=str)
def test_dequantize_bit_exact_on_every_byte(shape, out_dtype):
    # All 256 packed bytes and every finite scale byte (positive, negative, subnormal; NaN
    # 0x7F/0xFF left out only because NaN payloads need not agree), several s2.
    g = torch.Generator().manual_seed(11)
    k = shape[-1]
    packed = torch.randint(0, 256, (*shape[:-1], k // 2), generator=g, dtype=torch.uint8)
    sb = torch.randint(0, 256, (*shape[:-1], k // 16), generator=g, dtype=torch.uint8)
    sb = torch.where((sb & 0x7F) == 0x7F, sb - 1, sb)
    scales = sb.view(torch.float8_e4m3fn)
    for s2 in (1.0, 0.0123, 3e-41, 1e30):
        s2_t = torch.tensor(s2)
        ref = reference.dequantize(packed, scales, s2_t, out_dtype)
        out = dequantize_nvfp4(packed.to(CUDA), scales.to(CUDA), s2, out_dtype)
        assert out.dtype == out_dtype and out.shape == ref.shape
        assert torch.equal(bits(out.cpu()), bits(ref)), f"s2={s2}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_through_cuda_matches_cpu(dtype):
    x = random_input((65, 1024), dtype, "wide", seed=13)
    packed, scales, s2 = assert_quantize_matches_reference(x)
    out = dequantize_nvfp4(packed, scales, s2, dtype)
    ref = reference.dequantize(packed.cpu(), scales.cpu(), s2.cpu(), dtype)
    assert torch.equal(bits(out.cpu()), bits(ref))


# (The hand-made vectors run on CUDA too: test_nvfp4_vectors.py, parametrized by device.)


# --- Linear ---

SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (N, K): q, kv, gate/up, down
LINEAR_SHAPES = SMOLLM2 + [(4096, 4096), (1024, 8192), (100, 48), (72, 1040)]


@pytest.fixture
def _full_precision_reductions():
    """cuBLAS may otherwise reduce bf16/fp16 partial sums in half precision, which the
    reference's bound below does not allow for."""
    m = torch.backends.cuda.matmul
    old = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_fp16_reduced_precision_reduction = False
    yield
    m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


def make_weight(n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 10 ** torch.empty(n, 1).uniform_(-2, 1, generator=g)
    return quantize_nvfp4(w.to(dtype).to(CUDA))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("nk", LINEAR_SHAPES, ids=str)
def test_linear_matches_reference(nk, m, dtype, _full_precision_reductions):
    n, k = nk
    packed, scales, s2 = make_weight(n, k, dtype, seed=n + k)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(dtype).to(CUDA)
    bias = torch.randn(n, generator=g).to(dtype).to(CUDA) if m % 2 else None
    y = nvfp4_linear(x, packed, scales, s2, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    y_ref = reference.linear(x, packed, scales, s2, bias)  # torch on the GPU

    # The exact value of the layer, in fp64, from the exactly dequantized weight.
    w = reference.dequantize(packed, scales, s2, torch.float32).double()
    exact = x.double() @ w.T + (bias.double() if bias is not None else 0)
    mag = x.double().abs() @ w.abs().T + (bias.double().abs() if bias is not None else 0)
    # Tolerance. Triton: exact weights, fp32 sums, s2 and the bias applied in fp32, one
    # final rounding to x.dtype (half an ulp of |y|): |y - exact| <= (eps + acc) * mag, with
    # eps = 2^-8 (bf16) or 2^-11 (fp16) and acc = K * 2^-22 a worst-case bound for the fp32
    # sums (the tensor cores' accumulation is not promised to be IEEE fp32, hence 2^-22).
    # The reference first rounds every weight w * s2 to x.dtype (relative eps / 2 each),
    # then cuBLAS sums and rounds the output: within (2 * eps + acc) * mag. So Triton and
    # the reference agree within (3 * eps + 2 * acc) * mag. A wrong nibble, scale or K order
    # is off by whole weights, i.e. by the order of mag itself, far outside these bounds.
    eps = 2.0**-8 if dtype is torch.bfloat16 else 2.0**-11
    acc = k * 2.0**-22
    assert ((y.double() - exact).abs() <= (eps + acc) * mag + 1e-30).all()
    assert ((y_ref.double() - exact).abs() <= (2 * eps + acc) * mag + 1e-30).all()
    assert ((y.double() - y_ref.double()).abs() <= (3 * eps + 2 * acc) * mag + 1e-30).all()


@pytest.mark.parametrize("m", [1, 64])
def test_linear_decode_variants_and_splits_agree_bitwise(m):
    # The Triton kernel's inline-PTX decode and its plain Triton decode compute the same
    # weights bit for bit; with the same split and tiles the fp32 sums run in the same order,
    # so the outputs must be identical. Repeated calls must be identical too (split-K sums in
    # fixed order).
    from libs.kernels.nvfp4 import triton_configs, triton_kernel

    n, k = 1536, 4096
    packed, scales, s2 = make_weight(n, k, torch.bfloat16, seed=1)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    cfg = triton_configs.pick_config(m, n, k)
    outs = []
    for asm in (True, False):
        for _ in range(2):
            out = torch.empty(m, n, device=CUDA, dtype=torch.bfloat16)
            triton_kernel.launch(x, packed, scales, s2, None, out, dict(cfg, DECODE_ASM=asm))
            outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for split in (1, 2, 8):
        out = torch.empty(m, n, device=CUDA, dtype=torch.bfloat16)
        triton_kernel.launch(x, packed, scales, s2, None, out, {**cfg, "SPLIT_K": split})
        torch.testing.assert_close(out, outs[0], rtol=2**-7, atol=1e-3)


def test_linear_batched_and_fp32():
    packed, scales, s2 = make_weight(192, 576, torch.bfloat16, seed=2)
    x = torch.randn(2, 3, 576, device=CUDA, dtype=torch.bfloat16)
    y = nvfp4_linear(x, packed, scales, s2)
    assert y.shape == (2, 3, 192)
    flat = nvfp4_linear(x.reshape(6, 576), packed, scales, s2)
    torch.testing.assert_close(y.reshape(6, 192), flat)
    xf = torch.randn(5, 576, device=CUDA)
    bias = torch.randn(192, device=CUDA)
    # fp32 activations take dequantize + torch matmul: identical to the reference.
    assert torch.equal(
        nvfp4_linear(xf, packed, scales, s2, bias), reference.linear(xf, packed, scales, s2, bias)
    )


# --- Bad inputs raise the same typed errors on CUDA tensors. ---


def test_errors_on_cuda():
    x = torch.randn(4, 32, device=CUDA)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(x)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(2, 24, device=CUDA))
    with pytest.raises(TypeError, match="got torch.float64"):
        quantize_nvfp4(torch.randn(2, 32, device=CUDA, dtype=torch.float64))
    with pytest.raises(ValueError, match="positive and finite"):
        quantize_nvfp4(torch.randn(2, 32, device=CUDA), global_scale=0.0)
    packed, scales, s2 = quantize_nvfp4(torch.randn(8, 64, device=CUDA))
    with pytest.raises(TypeError, match="packed must be torch.uint8"):
        dequantize_nvfp4(packed.to(torch.int16), scales, s2)
    with pytest.raises(ValueError, match="disagree"):
        dequantize_nvfp4(packed[:4], scales, s2)
    with pytest.raises(ValueError, match="packed must be contiguous"):
        dequantize_nvfp4(packed[:, ::2], scales[:, ::2], s2)
    with pytest.raises(ValueError, match="x has K=32 but the weight has K=64"):
        nvfp4_linear(torch.randn(2, 32, device=CUDA), packed, scales, s2)
    with pytest.raises(TypeError, match="bias dtype"):
        nvfp4_linear(torch.randn(2, 64, device=CUDA), packed, scales, s2,
                     bias=torch.zeros(8, device=CUDA, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x is on cpu but the weight on cuda"):
        nvfp4_linear(torch.randn(2, 64), packed, scales, s2)


# fp16 at M = 256 with the wide 8-warp tile, split K: both decodes must hold the bound.
@pytest.mark.parametrize("asm", [True, False])
def test_linear_fp16_large_m_configs(asm, _full_precision_reductions):
    from libs.kernels.nvfp4 import triton_kernel

    n, k, m = 4096, 4096, 256
    packed, scales, s2 = make_weight(n, k, torch.float16, seed=n + k)
    w = reference.dequantize(packed, scales, s2, torch.float32).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.float16).to(CUDA)
    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT_K=4,
               DECODE_ASM=asm)
    out = torch.full((m, n), float("nan"), device=CUDA, dtype=torch.float16)
    triton_kernel.launch(x, packed, scales, s2.to(CUDA), None, out, cfg)
    exact = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    bad = (out.double() - exact).abs() > (2.0**-11 + k * 2.0**-22) * mag + 1e-30
    assert not bad.any(), (int(bad.sum()), ((out.double() - exact).abs() / mag)[bad].max().item())
