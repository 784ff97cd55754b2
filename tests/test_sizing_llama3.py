"""A prefill and a decode of the Llama-3 shapes sharing one 80 GB card: what each sizes its
KV pool to (libs/member/sizing.py), whichever starts first, and what stays free for
activations and decode graphs. Pure arithmetic on the memory figures: no GPU needed."""

from __future__ import annotations

import pytest
import torch

from libs.engine.specs import random_config
from libs.engine.weight_budget import weight_bytes
from libs.member.sizing import (
    DEFAULT_GPU_MEMORY_FRACTION,
    GIB,
    RESERVE_BYTES,
    DeviceMemory,
    kv_pages_that_fit,
)
from libs.transfer.kvwire import Nvfp4PageFormat

CARD = 80 * GIB
CONTEXT = 500 * 1024**2  # the CUDA context and NIXL, outside torch's count
PAGE = 16


def page_bytes(spec: str, kv: str) -> int:
    c = random_config(spec)
    page = c.n_layers * 2 * c.n_kv_heads * PAGE * c.head_dim * 2
    if kv == "nvfp4":
        page += Nvfp4PageFormat(c.n_layers, c.n_kv_heads, PAGE, c.head_dim).slot_bytes
    return page


@pytest.mark.parametrize("spec", ["random:llama3-8b", "random:llama3-1b"])
@pytest.mark.parametrize("weights", ["native", "nvfp4"])
@pytest.mark.parametrize("kv", ["native", "nvfp4"])
def test_prefill_and_decode_share_one_card_with_room_to_spare(spec, weights, kv):
    config = random_config(spec)
    held = weight_bytes(config, torch.bfloat16, weights, "cuda")
    per_page = page_bytes(spec, kv)
    fraction = DEFAULT_GPU_MEMORY_FRACTION / 2  # pdmesh up: one prefill, one decode
    one_context = -(-config.max_position // PAGE)
    used = 0
    for _member in ("first", "second"):
        used += CONTEXT + held  # its weights are loaded before it sizes its pool
        pages = kv_pages_that_fit(DeviceMemory(free=CARD - used, total=CARD, used_here=held),
                                  fraction, per_page, max_pages=256 * one_context)
        assert pages >= one_context  # at least one full 16k-token context
        used += pages * per_page
    free = CARD - used
    # each member's reserve (activations, decode graphs up to 256, sampling) is still there
    assert free >= 2 * RESERVE_BYTES, free / GIB
