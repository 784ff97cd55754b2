"""The NVFP4 KV page wire format (pure, no NIXL): exact round trip, byte layout, sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.engine.config import ModelConfig
from libs.kernels import dequantize_nvfp4, quantize_nvfp4
from libs.transfer import KvWire, Nvfp4PageFormat, UnsupportedKvShape
from libs.transfer.kvwire import SLOT_ALIGN

SMOL = ModelConfig.smollm2()
TINY = ModelConfig.tiny()


def fmt_of(config: ModelConfig, page_size: int = 16) -> Nvfp4PageFormat:
    return Nvfp4PageFormat(config.n_layers, config.n_kv_heads, page_size, config.head_dim)


def kv_pages(fmt: Nvfp4PageFormat, n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """KV-like pages: layers and K/V at very different scales, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *fmt.page_shape, generator=g)
    scale = torch.logspace(-3, 2, fmt.n_layers * 2).view(1, fmt.n_layers, 2, 1, 1, 1)
    x = x * scale
    x.view(-1)[:: 997] *= 50.0
    return x.to(dtype)


def expected_roundtrip(pages: torch.Tensor, last_page_tokens: int | None = None) -> torch.Tensor:
    """The definition: every (page, layer, K|V) tensor through the kernels' public API."""
    pages = pages.clone()
    if last_page_tokens is not None:
        pages[-1, :, :, :, last_page_tokens:] = 0
    out = torch.empty_like(pages)
    n, layers = pages.shape[:2]
    for p in range(n):
        for layer in range(layers):
            for kv in range(2):
                t = pages[p, layer, kv]
                out[p, layer, kv] = dequantize_nvfp4(*quantize_nvfp4(t), dtype=pages.dtype)
    return out


@pytest.mark.parametrize("config", [TINY, SMOL], ids=["tiny", "smollm2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_equals_public_api_exactly(config, dtype):
    fmt = fmt_of(config)
    pages = kv_pages(fmt, 3, dtype)
    got = fmt.roundtrip(pages)
    assert got.dtype == dtype
    assert torch.equal(got, expected_roundtrip(pages))  # bit for bit, -0.0 == 0.0 aside
    assert not torch.equal(got, pages)  # it is lossy


def test_slot_bytes_are_the_public_api_bytes_in_the_documented_layout():
    fmt = fmt_of(TINY)
    pages = kv_pages(fmt, 2)
    slots = fmt.encode(pages)
    assert slots.dtype == torch.uint8 and slots.shape == (2, fmt.slot_bytes)
    a, b = fmt.s2_bytes, fmt.s2_bytes + fmt.scales_bytes
    for p in range(2):
        s2 = slots[p, :a].clone().view(torch.float32).view(TINY.n_layers, 2)
        scales = slots[p, a:b].clone().view(torch.float8_e4m3fn)
        scales = scales.view(TINY.n_layers, 2, -1)
        packed = slots[p, b : b + fmt.packed_bytes].view(TINY.n_layers, 2, -1)
        for layer in range(TINY.n_layers):
            for kv in range(2):
                q, s, g = quantize_nvfp4(pages[p, layer, kv])
                assert s2[layer, kv].item() == g.item()
                want = s.view(torch.uint8).flatten()
                assert torch.equal(scales[layer, kv].view(torch.uint8), want)
                assert torch.equal(packed[layer, kv], q.flatten())
        assert not slots[p, b + fmt.packed_bytes :].any()  # padding is zero


def test_bytes_per_page_smollm2():
    fmt = fmt_of(SMOL)
    elements = 30 * 2 * 3 * 16 * 64
    assert fmt.packed_bytes == elements // 2 == 92160
    assert fmt.scales_bytes == elements // 16 == 11520
    assert fmt.s2_bytes == 30 * 2 * 4 == 240
    assert fmt.slot_bytes == 103920 and fmt.slot_bytes % SLOT_ALIGN == 0
    bf16, fp32 = elements * 2, elements * 4
    assert bf16 / fmt.slot_bytes == pytest.approx(3.547, abs=1e-3)  # 3.56 less the s2
    assert fp32 / fmt.slot_bytes == pytest.approx(7.094, abs=1e-3)


def test_bytes_per_page_tiny_and_wire_sizes():
    fmt = fmt_of(TINY)
    elements = 2 * 2 * 2 * 16 * 16
    assert fmt.payload_bytes == elements // 2 + elements // 16 + 2 * 2 * 4
    pool = torch.zeros(4, *fmt.page_shape)
    assert KvWire("native", pool).page_bytes == elements * 4
    wire = KvWire("nvfp4", pool)
    assert wire.page_bytes == fmt.slot_bytes and wire.region.shape == (4, fmt.slot_bytes)


def test_stale_tail_of_the_last_page_does_not_travel():
    fmt = fmt_of(TINY)
    pages = kv_pages(fmt, 2)
    dirty = pages.clone()
    dirty[-1, :, :, :, 5:] = 1e4  # stale KV of an earlier request
    assert torch.equal(fmt.encode(dirty, 5), fmt.encode(pages, 5))
    got = fmt.roundtrip(dirty, 5)
    assert torch.equal(got, expected_roundtrip(pages, 5))
    assert not got[-1, :, :, :, 5:].any()
    with pytest.raises(ValueError):
        fmt.encode(pages, 0)


def test_zero_pages_and_zero_tensors_decode_to_zero():
    fmt = fmt_of(TINY)
    pages = kv_pages(fmt, 2)
    pages[0] = 0
    pages[1, 1, 0] = 0  # one layer's K of a page
    got = fmt.roundtrip(pages)
    assert not got[0].any() and not got[1, 1, 0].any()
    slots = fmt.encode(pages)
    assert slots[0, : fmt.s2_bytes].clone().view(torch.float32).eq(1.0).all()  # s2 = 1.0


def test_bad_inputs_are_refused():
    fmt = fmt_of(TINY)
    with pytest.raises(ValueError):
        fmt.encode(torch.zeros(1, 3, 2, 2, 16, 16))
    bad = kv_pages(fmt, 1)
    bad[0, 0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fmt.encode(bad)
    with pytest.raises(ValueError):
        fmt.decode(torch.zeros(1, fmt.slot_bytes - 1, dtype=torch.uint8), torch.float32)


@pytest.mark.parametrize("head_dim", [8, 24, 72])
def test_head_dim_not_a_multiple_of_16_fails_clearly(head_dim):
    with pytest.raises(UnsupportedKvShape, match=f"head_dim is {head_dim}"):
        Nvfp4PageFormat(2, 2, 16, head_dim)
    with pytest.raises(UnsupportedKvShape):
        KvWire("nvfp4", torch.zeros(2, 2, 2, 2, 16, head_dim))
    assert KvWire("native", torch.zeros(2, 2, 2, 2, 16, head_dim)).staged is False


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown KV transfer format"):
        KvWire("fp8", torch.zeros(2, 2, 2, 2, 16, 16))


def test_pack_and_unpack_move_page_i_through_slot_i():
    fmt = fmt_of(TINY)
    src_pool = kv_pages(fmt, 8, seed=3)
    prefill = KvWire("nvfp4", src_pool)
    decode = KvWire("nvfp4", torch.full_like(src_pool, 7.0))
    prefill.pack([5, 2, 6], last_page_tokens=9)  # the prompt's pages, in order
    assert not prefill.region[[0, 1, 3, 4, 7]].any()  # only those slots were written
    # the "NIXL write": slots 5, 2, 6 of the prefill into slots 1, 4, 3 of the decode
    decode.region[[1, 4, 3]] = prefill.region[[5, 2, 6]]
    decode.unpack([1, 4, 3])
    want = expected_roundtrip(src_pool[[5, 2, 6]], 9)
    assert torch.equal(decode.pool[[1, 4, 3]], want)
    assert (decode.pool[[0, 2, 5, 6, 7]] == 7.0).all()  # other pages untouched


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 16]),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-20, 20),
)
def test_roundtrip_is_exact_for_any_shape_and_scale(n, layers, heads, page_size, blocks, seed,
                                                   log_scale):
    fmt = Nvfp4PageFormat(layers, heads, page_size, 16 * blocks)
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(n, *fmt.page_shape, generator=g) * 2.0**log_scale
    assert torch.equal(fmt.roundtrip(pages), expected_roundtrip(pages))
