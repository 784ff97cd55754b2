"""The NVFP4 KV page kernels (libs/kernels/nvfp4/kv_pages.py) against the wire format's
torch reference (libs/transfer/kvwire.py): the same slot bytes, the same decoded pages.

Where there is a GPU they run compiled on it; elsewhere under Triton's interpreter on CPU
tensors, in a subprocess (tests/kernels/interpreted.py). One exception to bit-exactness,
the interpreter's alone: its fp32 -> bf16 cast may round the other way by one ulp, so a
bf16 decode there is compared within one bf16 ulp (on a GPU, and in fp32 and fp16,
exactly).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from libs.transfer.kvwire import Nvfp4PageFormat  # noqa: E402
from tests.kernels.interpreted import (  # noqa: E402
    CUDA,
    DEVICE,
    INTERPRETED,
    kernels,
    run_module_interpreted,
)

if CUDA or INTERPRETED:
    from libs.kernels.nvfp4 import kv_pages


def test_kernels_under_the_interpreter():
    """This module's tests, run by Triton's interpreter in a fresh process."""
    run_module_interpreted(__file__)


# (layers, kv heads, page size, head_dim): the tiny spec, SmolLM2's heads, Llama-3's heads,
# a page size that is not a power of two; every shape in bf16 (what a GPU pool holds),
# fp32 and fp16 on one each (the interpreter is slow: a case is a couple of seconds)
TINY, SMOL, LLAMA, ODD = (2, 2, 16, 16), (3, 3, 16, 64), (2, 8, 16, 128), (1, 1, 5, 32)
CASES = [(shape, torch.bfloat16) for shape in (TINY, SMOL, LLAMA, ODD)] + [
    (ODD, torch.float32), (LLAMA, torch.float16)]


def _case_id(part) -> str:
    if isinstance(part, torch.dtype):
        return str(part).removeprefix("torch.")
    return "L{}-h{}-p{}-d{}".format(*part)


def _pool(shape, dtype, num_pages: int = 7, seed: int = 0) -> torch.Tensor:
    """KV-like pages: tensors at very different scales, some outliers, one all-zero."""
    layers, heads, page, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_pages, layers, 2, heads, page, head_dim, generator=g)
    x = x * torch.logspace(-3, 2, layers * 2).view(1, layers, 2, 1, 1, 1)
    x.view(-1)[::997] *= 50.0
    x[2, 0, 1] = 0.0
    return x.to(dtype)


def _fmt(shape) -> Nvfp4PageFormat:
    return Nvfp4PageFormat(*shape)


@kernels
@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=_case_id)
def test_encode_writes_the_references_bytes_into_the_slots_of_those_pages(shape, dtype):
    """A prompt's last page: its first 3 positions (the full-page case is the stale-tail
    test's first page)."""
    last = 3
    fmt, pool = _fmt(shape), _pool(shape, dtype)
    index = torch.tensor([5, 2, 0])
    slots = torch.full((pool.shape[0], fmt.slot_bytes), 0xAB, dtype=torch.uint8)
    want = fmt.encode(pool[index], last)

    got = slots.to(DEVICE)
    bad = kv_pages.encode_pages(pool.to(DEVICE), index.to(DEVICE), got, last)
    got = got.cpu()

    assert not bad.any()
    assert bad.shape == (3 * shape[0] * 2,)
    assert torch.equal(got[index, : fmt.payload_bytes], want[:, : fmt.payload_bytes])
    others = [i for i in range(pool.shape[0]) if i not in index.tolist()]
    assert (got[others] == 0xAB).all()  # no other slot touched


@kernels
@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=_case_id)
def test_decode_writes_the_references_values_into_those_pages(shape, dtype):
    fmt, source = _fmt(shape), _pool(shape, dtype)
    index = torch.tensor([1, 6, 2])
    slots = torch.zeros((source.shape[0], fmt.slot_bytes), dtype=torch.uint8)
    slots[index] = fmt.encode(source[index], 4 if shape[2] > 4 else None)
    want = fmt.decode(slots[index], dtype)
    pool = _pool(shape, dtype, seed=1)

    got = pool.to(DEVICE)
    kv_pages.decode_pages(slots.to(DEVICE), index.to(DEVICE), got)
    got = got.cpu()

    others = [i for i in range(pool.shape[0]) if i not in index.tolist()]
    assert torch.equal(got[others], pool[others])
    if INTERPRETED and dtype == torch.bfloat16:
        step = want.float().abs() * 2.0**-7  # one bf16 ulp at most
        assert ((got[index].float() - want.float()).abs() <= step).all()
    else:
        assert torch.equal(got[index], want)
    assert not torch.equal(got[index], source[index])  # lossy: it did decode


@kernels
def test_non_finite_elements_are_counted_per_tensor_of_each_page():
    shape = (2, 2, 16, 16)
    pool = _pool(shape, torch.float32)
    pool[3, 1, 0, 1, 2, 3] = float("nan")
    pool[3, 1, 0, 0, 0, 0] = float("inf")
    pool[4, 0, 1, 0, 9, 1] = float("-inf")
    pool[0, 0, 0, 0, 0, 0] = float("nan")  # a page not encoded
    slots = torch.zeros((pool.shape[0], _fmt(shape).slot_bytes), dtype=torch.uint8)
    index = torch.tensor([3, 4])

    bad = kv_pages.encode_pages(pool.to(DEVICE), index.to(DEVICE), slots.to(DEVICE))

    # tensors are (layer, K|V) in order, a page after a page
    assert bad.cpu().tolist() == [0, 0, 2, 0, 0, 1, 0, 0]


@kernels
def test_a_stale_tail_past_the_prompt_is_not_read():
    """Positions past last_page_tokens in the last page: a NaN there is not counted and a
    huge value does not move s2 (the reference zeroes them before it quantizes)."""
    shape = (1, 1, 16, 16)
    fmt, pool = _fmt(shape), _pool(shape, torch.float32)
    pool[5, 0, :, 0, 10] = float("nan")
    pool[5, 0, :, 0, 12] = 1e30
    slots = torch.zeros((pool.shape[0], fmt.slot_bytes), dtype=torch.uint8)
    index = torch.tensor([1, 5])
    want = fmt.encode(pool[index], 10)

    got = slots.to(DEVICE)
    bad = kv_pages.encode_pages(pool.to(DEVICE), index.to(DEVICE), got, 10)

    assert not bad.any()
    assert torch.equal(got.cpu()[index, : fmt.payload_bytes], want[:, : fmt.payload_bytes])


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_a_wire_packs_and_unpacks_through_the_kernels_on_a_gpu():
    """KvWire on a CUDA pool: the slots hold the reference's bytes, the decoded pages its
    values; NaN in the KV is refused with the wire format's error."""
    from libs.transfer import KvWire

    shape = (4, 8, 16, 128)
    pool = _pool(shape, torch.bfloat16, num_pages=9).cuda()
    wire = KvWire("nvfp4", pool)
    pages = [7, 3, 4]
    want = wire.format.encode(pool[pages].cpu(), 9)

    wire.pack(pages, 9)
    assert torch.equal(wire.region[pages].cpu()[:, : wire.format.payload_bytes],
                       want[:, : wire.format.payload_bytes])
    before = pool.clone()
    wire.unpack(pages)
    assert torch.equal(pool[pages].cpu(), wire.format.decode(want, torch.bfloat16))
    assert torch.equal(pool[[0, 1, 2, 5, 6, 8]], before[[0, 1, 2, 5, 6, 8]])

    pool[3, 2, 1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        wire.pack(pages)
