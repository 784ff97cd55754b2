"""Pick a (prefill, decode) pair for a request: least loaded, layouts that match.

A layout includes the KV transfer format (native | nvfp4): a prefill and a decode
registered with different formats are never paired, and when no compatible pair
is left the NoPair error says why each candidate pair was skipped.

The router counts its own in-flight requests per member; membership comes
from the bootstrap's Watch. Stubs are created lazily per member epoch, so a
restarted member (new epoch) never receives calls on the old one's channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from libs.member.pairable import layout_mismatch
from libs.rpc.calls import open_channel
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2_grpc as pgrpc


class NoPair(Exception):
    """No registered prefill and decode with matching layouts: the mesh cannot serve."""


@dataclass(eq=False)
class Endpoint:
    member: bpb.Member
    channel: grpc.aio.Channel
    stub: object
    inflight: int = 0
    # The requests using this member now, failed at once if it leaves (W5).
    requests: set = field(default_factory=set)

    @property
    def ref(self) -> cpb.PeerRef:
        return cpb.PeerRef(name=self.member.name, epoch=self.member.epoch)


@dataclass
class Pair:
    prefill: Endpoint
    decode: Endpoint

    def __enter__(self) -> Pair:
        self.prefill.inflight += 1
        self.decode.inflight += 1
        return self

    def __exit__(self, *exc) -> None:
        self.prefill.inflight -= 1
        self.decode.inflight -= 1


@dataclass
class Pairing:
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    retired: list[grpc.aio.Channel] = field(default_factory=list)

    def on_join(self, member: bpb.Member) -> None:
        if member.role not in (cpb.PREFILL, cpb.DECODE):
            return
        self.on_leave(member, "replaced")
        channel = open_channel(member.address)
        stub = (pgrpc.PrefillStub if member.role == cpb.PREFILL else dgrpc.DecodeStub)(channel)
        self.endpoints[member.name] = Endpoint(member, channel, stub)

    def on_leave(self, member: bpb.Member, reason: str) -> None:
        old = self.endpoints.get(member.name)
        if old is not None and old.member.epoch <= member.epoch:
            del self.endpoints[member.name]
            for request in list(old.requests):
                request.lose(member.name, reason)
            self.retired.append(old.channel)  # closed by the router's loop, not here

    def members(self, role: int) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.member.role == role]

    def reachable(self, role: int) -> list[Endpoint]:
        """Members whose channel is not failing to connect. A member that died is still
        registered until its lease ends; pairing with it would reserve pages on its
        partner for a request that cannot run."""
        failing = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        return [e for e in self.members(role) if e.channel.get_state() != failing]

    def pick(self, avoid: frozenset[str] = frozenset()) -> Pair:
        """The least loaded compatible pair; ties broken by name for determinism.

        Members in `avoid` (those a failed attempt just used) are taken only when
        no other compatible pair exists.
        """
        best: tuple[int, int, str, str] | None = None
        pair: Pair | None = None
        skipped: list[str] = []
        for p in self.reachable(cpb.PREFILL):
            for d in self.reachable(cpb.DECODE):
                names = (p.member.name, d.member.name)
                why = layout_mismatch(p.member.layout, d.member.layout, names)
                if why is not None:
                    skipped.append(why)
                    continue
                avoided = (p.member.name in avoid) + (d.member.name in avoid)
                score = (avoided, p.inflight + d.inflight, p.member.name, d.member.name)
                if best is None or score < best:
                    best, pair = score, Pair(p, d)
        if pair is None:
            detail = f": {'; '.join(skipped[:4])}" if skipped else ""
            raise NoPair(f"no reachable prefill/decode pair with matching KV layouts{detail}")
        return pair

    def can_serve(self) -> tuple[bool, str]:
        try:
            self.pick()
        except NoPair as e:
            return False, str(e)
        return True, "ok"
