"""What a member registers with NIXL for its KV transfer format, and the copies in and out.

``native`` registers the KV pool itself: a page travels as it is. ``nvfp4`` registers a
*staging* region instead: one wire slot per KV page, slot ``i`` carrying page ``i``
(same count, same ids). Because the mapping is the identity, everything that guards a KV
page guards its slot with it: TransferInfo's page ids, the prefill's fence before it frees
pages, the decode's quarantine of pages a writer may still write. Page counts stay in KV
pages everywhere.

The prefill calls :meth:`KvWire.pack` on pages it is about to write; the decode calls
:meth:`KvWire.unpack` once the KvReady notification said every slot landed. Both are
synchronous torch work; callers run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.member.formats import FORMATS, NATIVE
from libs.transfer.agent import settle
from libs.transfer.kvwire import Nvfp4PageFormat


class KvWire:
    """The registered region of one member and its page <-> slot conversion."""

    def __init__(self, name: str, pool_tensor: torch.Tensor) -> None:
        if name not in FORMATS:
            raise ValueError(f"unknown KV transfer format {name!r}; one of {FORMATS}")
        self.name = name
        self.pool = pool_tensor  # [num_pages, n_layers, 2, n_kv_heads, page_size, head_dim]
        num_pages = pool_tensor.shape[0]
        if name == NATIVE:
            self.format: Nvfp4PageFormat | None = None
            self.region = pool_tensor
            self.page_bytes = pool_tensor[0].numel() * pool_tensor.element_size()
        else:
            layers, _, heads, page_size, head_dim = pool_tensor.shape[1:]
            self.format = Nvfp4PageFormat(layers, heads, page_size, head_dim)
            self.region = torch.zeros(
                (num_pages, self.format.slot_bytes), dtype=torch.uint8, device=pool_tensor.device
            )
            self.page_bytes = self.format.slot_bytes

    @property
    def staged(self) -> bool:
        """True when pages must be packed before a write and unpacked after arrival."""
        return self.format is not None

    def pack(self, pages: Sequence[int], last_page_tokens: int | None = None) -> None:
        """Encode KV ``pages`` into their slots (same ids). See Nvfp4PageFormat.encode."""
        if self.format is None or not pages:
            return
        index = torch.tensor(list(pages), device=self.pool.device)
        self.format.pack_pages(self.pool, index, self.region, last_page_tokens)
        settle(self.region.device)  # the write posted next reads these slots

    def unpack(self, pages: Sequence[int]) -> None:
        """Decode the slots of ``pages`` into those KV pages, in the pool's dtype."""
        if self.format is None or not pages:
            return
        index = torch.tensor(list(pages), device=self.pool.device)
        self.format.unpack_pages(self.region, index, self.pool)
