"""Pairing by KV transfer format (no processes): only equal formats pair, and NoPair says why."""

from __future__ import annotations

import pytest

from libs.member.pairable import layout_mismatch
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from services.router.pairing import NoPair, Pairing


def member(role: int, name: str, fmt: str, port: int) -> bpb.Member:
    wire = 1168 if fmt == "nvfp4" else 8192
    layout = cpb.KvLayout(model="tiny@x", dtype="float32", page_size=16, num_layers=2,
                          num_kv_heads=2, head_dim=16, page_bytes=8192, transfer_format=fmt,
                          wire_page_bytes=wire)
    return bpb.Member(role=role, name=name, epoch=1, address=f"127.0.0.1:{port}", layout=layout)


def test_the_format_is_named_before_the_wire_size_it_implies():
    a = member(cpb.PREFILL, "p", "nvfp4", 1).layout
    b = member(cpb.DECODE, "d", "native", 2).layout
    assert layout_mismatch(a, b) == "transfer_format differs: ours 'nvfp4', theirs 'native'"
    assert layout_mismatch(a, b, ("p", "d")) == "transfer_format differs: p 'nvfp4', d 'native'"
    assert layout_mismatch(a, member(cpb.DECODE, "d", "nvfp4", 2).layout) is None


async def test_only_members_of_one_format_pair():
    pairing = Pairing()
    try:
        pairing.on_join(member(cpb.PREFILL, "prefill-n", "nvfp4", 1))
        pairing.on_join(member(cpb.DECODE, "decode-r", "native", 2))
        with pytest.raises(NoPair, match="transfer_format differs: prefill-n 'nvfp4', "
                                         "decode-r 'native'"):
            pairing.pick()
        assert pairing.can_serve()[0] is False
        pairing.on_join(member(cpb.DECODE, "decode-n", "nvfp4", 3))
        pairing.on_join(member(cpb.PREFILL, "prefill-r", "native", 4))
        for fmt, other in (("n", "r"), ("r", "n")):
            pair = pairing.pick(avoid=frozenset({f"prefill-{other}", f"decode-{other}"}))
            assert (pair.prefill.member.name, pair.decode.member.name) == (
                f"prefill-{fmt}", f"decode-{fmt}")
        # even avoiding the only compatible pair never yields a mixed one
        pair = pairing.pick(avoid=frozenset({"prefill-n", "decode-r"}))
        assert (pair.prefill.member.layout.transfer_format
                == pair.decode.member.layout.transfer_format)
    finally:
        for endpoint in pairing.endpoints.values():
            await endpoint.channel.close()
