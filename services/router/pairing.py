"""Pick a (prefill, decode) pair for a request: layouts that match, then the least KV
work and load (kv_score.py), by what each member holds in its prefix cache (kv_view.py).

A layout includes the KV transfer format (native | nvfp4): a prefill and a decode
registered with different formats are never paired, and when no compatible pair
is left the NoPair error says why each candidate pair was skipped.

With ``kv_routing`` off the pair is the least loaded one (ties by name), whatever the
members hold (the view still counts where each request landed, for comparison). The
router counts its own in-flight requests per member; membership comes
from the bootstrap's Watch. Stubs are created lazily per member epoch, so a
restarted member (new epoch) never receives calls on the old one's channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import anyio
import grpc

from libs.engine.prefix_cache import page_keys
from libs.member.pairable import layout_mismatch
from libs.rpc.calls import open_channel
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import decode_pb2_grpc as dgrpc
from pdmesh.v1 import prefill_pb2_grpc as pgrpc
from services.router import kv_score
from services.router.kv_view import KvView


class NoPair(Exception):
    """No registered prefill and decode with matching layouts: the mesh cannot serve."""


@dataclass(eq=False)
class Endpoint:
    member: bpb.Member
    channel: grpc.aio.Channel
    stub: object
    inflight: int = 0
    placed: int = 0  # requests placed here since it joined
    # The requests using this member now, failed at once if it leaves (W5).
    requests: set = field(default_factory=set)
    # The scope of this member's KvEvents follower (services/router/kv_watch.py). It is
    # cancelled the moment the member leaves, before its channel is retired: a follower
    # that outlived its channel would call on a closed one.
    follower: anyio.CancelScope | None = None

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
    view: KvView = field(default_factory=KvView)
    kv_routing: bool = True
    weights: kv_score.Weights = field(default_factory=kv_score.Weights)
    on_route: Callable[[str], None] = lambda outcome: None  # cold | landed | elsewhere

    def on_join(self, member: bpb.Member) -> None:
        if member.role not in (cpb.PREFILL, cpb.DECODE):
            return
        self.on_leave(member, "replaced")
        channel = open_channel(member.address)
        stub = (pgrpc.PrefillStub if member.role == cpb.PREFILL else dgrpc.DecodeStub)(channel)
        self.endpoints[member.name] = Endpoint(member, channel, stub)
        self.view.join(member.name, member.epoch, member.layout.model)

    def on_leave(self, member: bpb.Member, reason: str) -> None:
        old = self.endpoints.get(member.name)
        if old is not None and old.member.epoch <= member.epoch:
            del self.endpoints[member.name]
            if old.follower is not None:
                old.follower.cancel()
            self.view.leave(member.name, member.epoch)
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

    def pick(self, avoid: frozenset[str] = frozenset(), prompt: Sequence[int] = ()) -> Pair:
        """The compatible pair of least cost (kv_score.py) for ``prompt``.

        Members in `avoid` (those a failed attempt just used) are taken only when
        no other compatible pair exists.
        """
        candidates: list[tuple[kv_score.Candidate, Pair]] = []
        skipped: list[str] = []
        keys: dict[tuple[str, int], list[bytes]] = {}  # per (model, page size)
        for p in self.reachable(cpb.PREFILL):
            for d in self.reachable(cpb.DECODE):
                names = (p.member.name, d.member.name)
                why = layout_mismatch(p.member.layout, d.member.layout, names)
                if why is not None:
                    skipped.append(why)
                    continue
                layout = p.member.layout
                prompt_keys: list[bytes] = []
                if prompt:
                    at = (layout.model, layout.page_size)
                    if at not in keys:
                        keys[at] = page_keys(layout.model, layout.page_size, prompt)
                    prompt_keys = keys[at]
                candidates.append((kv_score.Candidate(
                    prefill=p.member.name, decode=d.member.name,
                    prefill_hit=self.view.held(p.member.name, prompt_keys),
                    decode_hit=self.view.held(d.member.name, prompt_keys),
                    load=p.inflight + d.inflight,
                    placed=p.placed + d.placed,
                    avoided=(p.member.name in avoid) + (d.member.name in avoid),
                ), Pair(p, d)))
        if not candidates:
            detail = f": {'; '.join(skipped[:4])}" if skipped else ""
            raise NoPair(f"no reachable prefill/decode pair with matching KV layouts{detail}")
        scored = [c for c, _ in candidates]
        page_size = candidates[0][1].prefill.member.layout.page_size or 1
        if self.kv_routing:
            chosen = kv_score.best(scored, len(prompt), page_size, self.weights)
        else:  # by load alone; the view still says where the turn landed
            blind = [replace(c, prefill_hit=0, decode_hit=0, placed=0) for c in scored]
            chosen = scored[blind.index(kv_score.best(blind, len(prompt), page_size))]
        pair = candidates[scored.index(chosen)][1]
        if prompt:
            self.on_route(kv_score.landing(chosen, scored))
            at = (pair.prefill.member.layout.model, page_size)
            if self.kv_routing and at in keys:  # what it will leave cached on both members
                self.view.predict(chosen.prefill, keys[at])
                self.view.predict(chosen.decode, keys[at])
            pair.prefill.placed += 1
            pair.decode.placed += 1
        return pair

    def can_serve(self) -> tuple[bool, str]:
        try:
            self.pick()
        except NoPair as e:
            return False, str(e)
        return True, "ok"
