"""The warp-specialized Gluon GEMM (libs/kernels/nvfp4/gemm_kernel.py) on CUDA: its configs
against the exact product (ragged M and N, bias, fp16, split-K, one to three decode
partitions), every e4m3 scale code and byte, determinism, no writes outside the output,
and nvfp4_linear's routing to it. GPU only (marked `gpu`)."""

import pytest
import torch

from libs.kernels.nvfp4 import reference

pytestmark = pytest.mark.gpu
CUDA = "cuda"

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
gk = pytest.importorskip("libs.kernels.nvfp4.gemm_kernel")
from libs.kernels.nvfp4 import linear_kernels as lk  # noqa: E402  (after the skip)


def _cfg(bm=256, split=1, decoders=2, stages=4, w_stages=8):
    return dict(BN=64, BM=bm, BK=64, G=4, STAGES=stages, W_STAGES=w_stages, S_STAGES=2,
                decoders=decoders, decode_regs=96 if decoders < 3 else 88, SPLIT_K=split)


CONFIGS = [_cfg(), _cfg(bm=128), _cfg(split=2), _cfg(bm=128, split=4), _cfg(decoders=1),
           _cfg(decoders=3), _cfg(stages=3, w_stages=4), _cfg(bm=64)]


def _weight(n, k, dtype, seed, random_scales=False):
    g = torch.Generator().manual_seed(seed)
    if random_scales:  # every byte pattern of packed, every finite e4m3 scale code
        packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
        codes = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
        codes[0, : min(k // 16, 0x7F)] = torch.arange(min(k // 16, 0x7F), dtype=torch.uint8)
        s2 = torch.tensor(2.0**-20)
        return packed.to(CUDA), codes.view(torch.float8_e4m3fn).to(CUDA), s2.to(CUDA)
    from libs.kernels import quantize_nvfp4

    w = torch.randn(n, k, generator=g) * 10 ** torch.empty(n, 1).uniform_(-2, 1, generator=g)
    return quantize_nvfp4(w.to(dtype).to(CUDA))


def _check(out, x, packed, scales, s2, bias, dtype):
    w = reference.dequantize(packed, scales, s2, torch.float32).double()
    exact = x.double() @ w.T + (bias.double() if bias is not None else 0)
    mag = x.double().abs() @ w.abs().T + (bias.double().abs() if bias is not None else 0)
    eps = 2.0**-8 if dtype is torch.bfloat16 else 2.0**-11
    bound = (eps + x.shape[1] * 2.0**-22) * mag + 1e-30  # as test_linear_matches_reference
    bad = ~((out.double() - exact).abs() <= bound)  # NaN (never written) counts as bad
    assert not bad.any(), (int(bad.sum()), bad.nonzero()[:5].tolist())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_configs_match_exact(cfg, dtype):
    ran = 0
    for n, k, m in ((256, 1024, 100), (200, 2048, 256), (64, 4096, 300), (1000, 768, 129),
                    (136, 2048, 17)):
        if not gk.fits(m, k, cfg):
            continue
        ran += 1
        packed, scales, s2 = _weight(n, k, dtype, seed=n + k)
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, k, generator=g).to(dtype).to(CUDA)
        bias = torch.randn(n, generator=g).to(dtype).to(CUDA) if m % 2 else None
        out = torch.full((m, n), float("nan"), device=CUDA, dtype=dtype)
        gk.launch(x, packed, scales, s2.float(), bias, out, cfg)
        _check(out, x, packed, scales, s2, bias, dtype)
    assert ran >= 3, cfg  # every config meets at least three of the shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_every_scale_code_and_byte(dtype):
    packed, scales, s2 = _weight(256, 4096, dtype, seed=3, random_scales=True)
    x = torch.randn(130, 4096, device=CUDA).to(dtype)
    out = torch.full((130, 256), float("nan"), device=CUDA, dtype=dtype)
    gk.launch(x, packed, scales, s2, None, out, _cfg(split=2))
    _check(out, x, packed, scales, s2, None, dtype)


def test_gemm_is_deterministic_and_leaves_counters_clean():
    cfg = _cfg(split=4)
    packed, scales, s2 = _weight(512, 4096, torch.bfloat16, seed=4)
    x = torch.randn(256, 4096, device=CUDA, dtype=torch.bfloat16)
    outs = []
    for _ in range(3):
        out = torch.empty(256, 512, device=CUDA, dtype=torch.bfloat16)
        gk.launch(x, packed, scales, s2, None, out, cfg)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert not lk._tile_counters(x.device, 8)[:8].any()


def test_gemm_does_not_write_past_m_or_n():
    packed, scales, s2 = _weight(120, 1024, torch.bfloat16, seed=5)
    x = torch.randn(70, 1024, device=CUDA, dtype=torch.bfloat16)
    big = torch.full((300, 136), 7.0, device=CUDA, dtype=torch.bfloat16)
    out = big[:70, :120]  # row stride 136 (272 bytes): writes past n or m show in big
    gk.launch(x, packed, scales, s2, None, out, _cfg(bm=128))
    assert (big[70:] == 7).all() and (big[:, 120:] == 7).all()
    _check(out, x, packed, scales, s2, None, torch.bfloat16)


def test_fits_and_pick_config():
    assert gk.fits(256, 4096, _cfg(split=4)) and not gk.fits(256, 4096 + 256, _cfg(split=2))
    assert not gk.fits(256, 576, _cfg())  # K not whole 256-wide scale slots
    big = gk.pick_config(256, 8192, 28672)
    assert (big["BM"], big["SPLIT_K"]) == (256, 1)  # 128 tiles already fill an H200
    square = gk.pick_config(256, 4096, 4096)
    assert (square["BM"], square["SPLIT_K"]) == (256, 2)  # 64 tiles: split K in two
    assert gk.pick_config(100, 4096, 4096)["BM"] == 128
    assert gk.pick_config(95, 8192, 28672) is None  # few tokens: the weight stream
    assert gk.pick_config(256, 1536, 576) is None  # small layers: linear_kernels
    assert gk.pick_config(256, 4100, 4096) is None  # N not a multiple of 8


def test_linear_routes_to_the_gemm_only_where_it_can():
    # nvfp4_linear hands 256 tokens on this layer to the GEMM; x starting 2 bytes into a
    # buffer cannot make a TMA descriptor and takes the Triton kernel instead. Both must
    # hold the bound.
    from libs.kernels import nvfp4_linear

    n, k = 4096, 4096
    packed, scales, s2 = _weight(n, k, torch.bfloat16, seed=6)
    x = torch.randn(256, k, device=CUDA, dtype=torch.bfloat16)
    buf = torch.empty(x.numel() + 1, dtype=torch.bfloat16, device=CUDA)
    shifted = buf[1:].view(256, k)
    shifted.copy_(x)
    out = torch.empty(256, n, device=CUDA, dtype=torch.bfloat16)
    assert lk.route(x, packed, scales, out)[0] == "gemm"
    assert lk.route(shifted, packed, scales, out)[0] == "triton"
    assert lk.route(x[:95], packed, scales, out[:95])[0] == "triton"
    assert lk.route(x[:96], packed, scales, out[:96])[0] == "gemm"
    assert lk.route(x[:1], packed, scales, out[:1])[0] == "gemv"
    for xx in (x, shifted):
        _check(nvfp4_linear(xx, packed, scales, s2), xx, packed, scales, s2, None,
               torch.bfloat16)
