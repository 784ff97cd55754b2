"""KV-aware pairing without processes: the pure score, the view built from cache events
(epoch and model checks, snapshots, predictions that expire), and Pairing choosing by them."""

from __future__ import annotations

import pytest

from libs.engine.prefix_cache import PrefixCache, page_keys
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import kvevents_pb2 as kpb
from services.router.kv_score import Candidate, Weights, best, cost, landing
from services.router.kv_view import KvView
from services.router.pairing import Pairing

MODEL = "tiny@abc"


def cand(p="p0", d="d0", ph=0, dh=0, load=0, placed=0, avoided=0) -> Candidate:
    return Candidate(p, d, ph, dh, load, placed, avoided)


def test_cost_counts_tokens_computed_and_moved_plus_load():
    w = Weights(compute=1.0, move=0.5, load=100.0)
    assert cost(cand(), 160, 16, w) == 160 + 80
    assert cost(cand(ph=4, dh=2), 160, 16, w) == (160 - 64) + 0.5 * (160 - 32)
    # a prompt held whole still computes its last token on the prefill, moves nothing
    assert cost(cand(ph=10, dh=10), 160, 16, w) == 1
    assert cost(cand(load=3), 160, 16, w) == 160 + 80 + 300


def test_best_prefers_held_kv_until_load_outweighs_it():
    w = Weights(compute=1.0, move=0.25, load=100.0)
    warm = cand("p0", "d0", ph=20, dh=20, load=2)
    cold = cand("p1", "d1", load=0)
    assert best([cold, warm], 400, 16, w) is warm  # 80 + 200 < 400 + 100
    busy = cand("p0", "d0", ph=20, dh=20, load=6)
    assert best([cold, busy], 400, 16, w) is cold  # 80 + 600 > 500


def test_best_spreads_cold_requests_and_avoids_failed_members_last():
    a, b = cand("p0", "d0", placed=2), cand("p1", "d1", placed=0)
    assert best([a, b], 100, 16) is b
    assert best([cand("p0", "d0", ph=5, avoided=1), b], 100, 16) is b
    only = cand("p0", "d0", avoided=2)
    assert best([only], 100, 16) is only
    with pytest.raises(ValueError):
        best([], 100, 16)


def test_landing_outcomes():
    a, b = cand("p0", "d0", ph=3, dh=4), cand("p1", "d1")
    assert landing(a, [a, b]) == "landed"
    assert landing(b, [a, b]) == "elsewhere"
    assert landing(b, [b, cand("p0", "d1")]) == "cold"
    mixed = cand("p0", "d1", ph=3, dh=0)
    assert landing(mixed, [a, b, mixed]) == "elsewhere"  # the decode with KV was passed over


def event(kind, keys, name="d0", epoch=1, model=MODEL, enabled=True) -> kpb.KvCacheEvent:
    return kpb.KvCacheEvent(member=cpb.PeerRef(name=name, epoch=epoch), model=model, kind=kind,
                            page_keys=keys, page_size=16, enabled=enabled)


def test_view_applies_events_of_the_paired_epoch_and_model_only():
    ignored = []
    view = KvView(on_ignored=ignored.append)
    keys = page_keys(MODEL, 16, list(range(64)))
    view.join("d0", 1, MODEL)
    assert view.held("d0", keys) == 0
    assert view.apply("d0", event(kpb.KvCacheEvent.STORED, keys[:3]))
    assert view.held("d0", keys) == 3
    assert not view.apply("d0", event(kpb.KvCacheEvent.STORED, keys, epoch=2))
    assert not view.apply("d0", event(kpb.KvCacheEvent.STORED, keys, model="other@1"))
    assert not view.apply("d9", event(kpb.KvCacheEvent.STORED, keys, name="d9"))
    assert view.held("d0", keys) == 3
    assert ignored == ["epoch", "model", "epoch"] and view.ignored == {"epoch": 2, "model": 1}
    # a removed page in the middle cuts the prefix there
    assert view.apply("d0", event(kpb.KvCacheEvent.REMOVED, keys[1:2]))
    assert view.held("d0", keys) == 1
    # a snapshot replaces the view
    assert view.apply("d0", event(kpb.KvCacheEvent.SNAPSHOT, keys[:2]))
    assert view.held("d0", keys) == 2
    # a restart (new epoch) starts empty; the old epoch's events are now ignored
    view.join("d0", 2, MODEL)
    assert view.held("d0", keys) == 0
    assert not view.apply("d0", event(kpb.KvCacheEvent.STORED, keys))
    view.leave("d0", 2)
    assert view.held("d0", keys) == 0


def test_predictions_count_until_they_expire():
    now = [100.0]
    view = KvView(ttl=2.0, clock=lambda: now[0])
    keys = page_keys(MODEL, 16, list(range(80)))
    view.join("p0", 1, MODEL)
    view.predict("p0", keys[:4])  # no snapshot yet: nothing is known to be cached there
    assert view.held("p0", keys) == 0
    view.apply("p0", event(kpb.KvCacheEvent.SNAPSHOT, [], name="p0"))
    view.predict("p0", keys[:4])
    assert view.held("p0", keys) == 4
    now[0] += 2.5
    assert view.held("p0", keys) == 0
    # a member whose cache is off never counts as holding what was sent to it
    view.join("p1", 1, MODEL)
    view.apply("p1", event(kpb.KvCacheEvent.SNAPSHOT, [], name="p1", enabled=False))
    view.predict("p1", keys[:4])
    assert view.held("p1", keys) == 0


def test_router_keys_equal_the_members_cache_keys():
    cache = PrefixCache(MODEL, 16)
    tokens = list(range(1000, 1000 + 70))
    stored = []
    cache.listener = lambda kind, keys: stored.append((kind, keys))
    assert cache.insert(tokens, [0, 1, 2, 3]) == 4
    assert stored == [("stored", page_keys(MODEL, 16, tokens))]
    assert cache.keys() == page_keys(MODEL, 16, tokens)
    for page in (3, 2):
        cache.release(page)
    assert cache.evict(2) and stored[-1][0] == "removed"
    assert set(stored[-1][1]) == set(page_keys(MODEL, 16, tokens)[2:])


def member(role: int, name: str, port: int, epoch: int = 1) -> bpb.Member:
    layout = cpb.KvLayout(model=MODEL, dtype="float32", page_size=16, num_layers=2,
                          num_kv_heads=2, head_dim=16, page_bytes=8192,
                          transfer_format="native", wire_page_bytes=8192)
    return bpb.Member(role=role, name=name, epoch=epoch, address=f"127.0.0.1:{port}",
                      layout=layout)


async def test_pairing_follows_the_kv_and_spreads_cold_conversations():
    outcomes: list[str] = []
    pairing = Pairing(on_route=outcomes.append)
    try:
        for i, (role, name) in enumerate([(cpb.PREFILL, "p0"), (cpb.PREFILL, "p1"),
                                          (cpb.DECODE, "d0"), (cpb.DECODE, "d1")]):
            pairing.on_join(member(role, name, 1 + i))
            pairing.view.apply(name, event(kpb.KvCacheEvent.SNAPSHOT, [], name=name))
        a, b = list(range(200)), list(range(5000, 5200))
        pa, pb = pairing.pick(prompt=a), pairing.pick(prompt=b)
        names = lambda p: (p.prefill.member.name, p.decode.member.name)  # noqa: E731
        assert {names(pa), names(pb)} == {("p0", "d0"), ("p1", "d1")}  # spread, not piled
        # the next turns (history plus more) follow their placements
        assert names(pairing.pick(prompt=a + list(range(300, 340)))) == names(pa)
        assert names(pairing.pick(prompt=b + list(range(300, 340)))) == names(pb)
        assert outcomes == ["cold", "cold", "landed", "landed"]
        # the decode's own events (longer: prompt and answer) pull toward it too
        keys = page_keys(MODEL, 16, b)
        other_decode = "d0" if names(pb)[1] == "d1" else "d1"
        pairing.view.apply(other_decode, event(kpb.KvCacheEvent.STORED, keys, name=other_decode))
        assert names(pairing.pick(prompt=b))[0] == names(pb)[0]
        # a member that restarts (new epoch) forgets what its old epoch held
        pairing.on_join(member(cpb.PREFILL, names(pa)[0], 9, epoch=2))
        assert pairing.view.held(names(pa)[0], page_keys(MODEL, 16, a)) == 0
        # off: load alone, names break ties
        pairing.kv_routing = False
        assert names(pairing.pick(prompt=b)) == ("p0", "d0")
    finally:
        for endpoint in pairing.endpoints.values():
            await endpoint.channel.close()
