"""Whether two members can exchange KV: a comparison of their registered layouts.

Kept apart from kv_member (which owns a model and a KV pool) so the router, which pairs
members but never computes, checks the same rule without importing torch.
"""

from __future__ import annotations

from pdmesh.v1 import common_pb2 as cpb


def layout_mismatch(
    ours: cpb.KvLayout, theirs: cpb.KvLayout, names: tuple[str, str] = ("ours", "theirs")
) -> str | None:
    """Why two members cannot exchange KV, or None when they can.

    The transfer format is compared first: it is the one an operator sets per member
    (--kv-transfer), and the derived wire_page_bytes would otherwise hide it.
    """
    for name in (
        "transfer_format", "model", "dtype", "page_size", "num_layers", "num_kv_heads",
        "head_dim", "page_bytes", "wire_page_bytes",
    ):
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            return f"{name} differs: {names[0]} {a!r}, {names[1]} {b!r}"
    return None
