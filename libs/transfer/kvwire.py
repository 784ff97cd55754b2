"""KV page wire formats: how one KV page travels between a prefill and a decode.

``native``: the page's own bytes (engine dtype), written straight from pool to pool.

``nvfp4``: every page becomes one fixed-size *slot* of bytes, the NVFP4 encoding of the page
(libs/kernels; docs/nvfp4.md). A KV page is
``[n_layers, 2 (K, V), n_kv_heads, page_size, head_dim]``; each of its ``n_layers * 2``
tensors ``[n_kv_heads, page_size, head_dim]`` is quantized on its own, blocks of 16 along
head_dim, with its own per-tensor scale ``s2 = amax / 2688`` (1.0 when all zero) taken from
that tensor of that page. Why per (page, layer, K|V): K and V, and layers, differ in range
by orders of magnitude; an s2 shared across them would push the small ones' e4m3 block
scales into subnormals. Why per page: a page is quantized once, when it is complete, with no
state shared between pages or requests, so any subset of pages can travel and be decoded.

Slot layout (byte offsets from the slot's start; little-endian, C order)::

    s2      fp32            [n_layers, 2]                                  at 0
    scales  float8_e4m3fn   [n_layers, 2, n_kv_heads, page_size, head_dim/16]
    packed  uint8 (E2M1 x2) [n_layers, 2, n_kv_heads, page_size, head_dim/2]
    zero padding to a multiple of 16 bytes

Element 0 in the low nibble of each packed byte; scales in the linear (checkpoint) layout.
Decoding gives exactly ``dequantize_nvfp4(*quantize_nvfp4(t), dtype)`` for every tensor
``t`` of the page (tests/transfer/test_kvwire.py checks it bit for bit).

Positions past the prompt in its last page hold stale KV of an earlier request; they are
zeroed before quantizing so they cannot move s2 (and what travels depends on this request
only).

Two implementations give the same bytes: the torch reference (any device; the
definition, and the CPU's path), and on a GPU the Triton kernels of
libs/kernels/nvfp4/kv_pages.py, which read and write the pool by page id, one launch a
batch of pages, with no host sync (:meth:`Nvfp4PageFormat.pack_pages` and
:meth:`Nvfp4PageFormat.unpack_pages` choose).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libs.kernels.nvfp4 import reference, triton_available
from libs.kernels.nvfp4.format import BLOCK

SLOT_ALIGN = 16
NON_FINITE = "KV contains NaN or Inf; NVFP4 cannot encode them"


class UnsupportedKvShape(ValueError):
    """The model's KV shape cannot travel in the requested format (e.g. head_dim % 16)."""


@dataclass(frozen=True)
class Nvfp4PageFormat:
    """Shape of one KV page and the byte layout of its NVFP4 slot."""

    n_layers: int
    n_kv_heads: int
    page_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim % BLOCK:
            raise UnsupportedKvShape(
                f"--kv-transfer nvfp4 quantizes KV in blocks of {BLOCK} along head_dim, but "
                f"this model's head_dim is {self.head_dim} (not a multiple of {BLOCK}); "
                f"use --kv-transfer native"
            )

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.n_layers, 2, self.n_kv_heads, self.page_size, self.head_dim)

    @property
    def _rows(self) -> int:
        """Rows of head_dim in one page."""
        return self.n_layers * 2 * self.n_kv_heads * self.page_size

    @property
    def s2_bytes(self) -> int:
        return self.n_layers * 2 * 4

    @property
    def scales_bytes(self) -> int:
        return self._rows * (self.head_dim // BLOCK)

    @property
    def packed_bytes(self) -> int:
        return self._rows * (self.head_dim // 2)

    @property
    def payload_bytes(self) -> int:
        return self.s2_bytes + self.scales_bytes + self.packed_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one KV page takes on the wire (payload padded to SLOT_ALIGN)."""
        return -(-self.payload_bytes // SLOT_ALIGN) * SLOT_ALIGN

    def encode(self, pages: torch.Tensor, last_page_tokens: int | None = None) -> torch.Tensor:
        """KV pages ``[n, *page_shape]`` (any float dtype) -> slots ``uint8 [n, slot_bytes]``.

        ``last_page_tokens``: positions of the last page that hold this request's KV; the
        rest of that page is zeroed first (see the module docstring). None: every page full.
        """
        self._check_pages(pages)
        if self._check_last(last_page_tokens) < self.page_size:
            pages = pages.clone()
            pages[-1, :, :, :, last_page_tokens:] = 0
        if not torch.isfinite(pages).all():
            raise ValueError(NON_FINITE)
        n = pages.shape[0]
        s2 = reference.global_scale_from_amax(pages.abs().amax(dim=(3, 4, 5)).float())  # [n, L, 2]
        packed, scales = reference.quantize(pages, s2[..., None, None, None])
        parts = [
            s2.reshape(n, -1).view(torch.uint8),
            scales.reshape(n, -1).view(torch.uint8),
            packed.reshape(n, -1),
        ]
        pad = self.slot_bytes - self.payload_bytes
        if pad:
            parts.append(torch.zeros((n, pad), dtype=torch.uint8, device=pages.device))
        return torch.cat(parts, dim=1)

    def decode(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Slots ``uint8 [n, slot_bytes]`` -> KV pages ``[n, *page_shape]`` in ``dtype``."""
        if slots.dtype != torch.uint8 or slots.ndim != 2 or slots.shape[1] != self.slot_bytes:
            raise ValueError(f"slots must be uint8 [n, {self.slot_bytes}], got "
                             f"{slots.dtype} {tuple(slots.shape)}")
        n = slots.shape[0]
        a, b = self.s2_bytes, self.s2_bytes + self.scales_bytes
        c = b + self.packed_bytes
        s2 = slots[:, :a].contiguous().view(torch.float32).view(n, self.n_layers, 2)
        scales = slots[:, a:b].contiguous().view(torch.float8_e4m3fn)
        scales = scales.view(n, *self.page_shape[:-1], self.head_dim // BLOCK)
        packed = slots[:, b:c].reshape(n, *self.page_shape[:-1], self.head_dim // 2)
        return reference.dequantize(packed, scales, s2[..., None, None, None], dtype)

    def pack_pages(self, pool: torch.Tensor, index: torch.Tensor, slots: torch.Tensor,
                   last_page_tokens: int | None = None) -> None:
        """Encode pool pages ``index`` into the slots of the same ids (a staging region
        ``uint8 [num_pages, slot_bytes]``), returning once the device has written them.

        On a GPU with triton, one kernel launch reads the pages where they are; elsewhere
        the reference encodes a gathered copy. Raises ValueError for NaN or Inf in the
        KV (slots ``index`` then hold garbage; nothing else is touched)."""
        self._check_last(last_page_tokens)
        self._check_region(pool, slots)
        if not (pool.is_cuda and triton_available()):
            slots[index] = self.encode(pool[index], last_page_tokens)
            return
        from libs.kernels.nvfp4 import kv_pages

        bad = kv_pages.encode_pages(pool, index, slots, last_page_tokens)
        if bad.any().item():  # waits for the kernel: the one host sync
            raise ValueError(NON_FINITE)

    def unpack_pages(self, slots: torch.Tensor, index: torch.Tensor,
                     pool: torch.Tensor) -> None:
        """Decode slots ``index`` into the pool pages of the same ids, in the pool's dtype
        (queued on the current stream, like any other write of the pool)."""
        self._check_region(pool, slots)
        if not (pool.is_cuda and triton_available()):
            pool[index] = self.decode(slots[index], pool.dtype)
            return
        from libs.kernels.nvfp4 import kv_pages

        kv_pages.decode_pages(slots, index, pool)

    def roundtrip(self, pages: torch.Tensor, last_page_tokens: int | None = None) -> torch.Tensor:
        """What the decode's pool holds after these pages travelled (tests, benchmarks)."""
        return self.decode(self.encode(pages, last_page_tokens), pages.dtype)

    def _check_last(self, last_page_tokens: int | None) -> int:
        """Positions of the last page to encode (page_size when None), checked."""
        if last_page_tokens is None:
            return self.page_size
        if not 1 <= last_page_tokens <= self.page_size:
            raise ValueError(f"last_page_tokens must be in 1..{self.page_size}")
        return last_page_tokens

    def _check_region(self, pool: torch.Tensor, slots: torch.Tensor) -> None:
        """A KV pool and its staging region: one slot of this format a page."""
        self._check_pages(pool)
        if slots.dtype != torch.uint8 or tuple(slots.shape) != (pool.shape[0], self.slot_bytes):
            raise ValueError(f"slots must be uint8 [{pool.shape[0]}, {self.slot_bytes}], got "
                             f"{slots.dtype} {tuple(slots.shape)}")

    def _check_pages(self, pages: torch.Tensor) -> None:
        if tuple(pages.shape[1:]) != self.page_shape or pages.shape[0] < 1:
            raise ValueError(f"pages must be [n>=1, {', '.join(map(str, self.page_shape))}], "
                             f"got {tuple(pages.shape)}")
