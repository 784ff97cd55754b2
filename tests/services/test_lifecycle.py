"""The request lifecycle both members share: how a request ends, and how an Abort is
answered (libs/member/lifecycle.py, libs/member/service.py), without a model or NIXL."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace

import anyio
import grpc
import pytest

from libs.kvpoll import FailureCause, RoomKey, RoomState, RoomTable
from libs.member import service as member_service
from libs.member.lifecycle import Lifecycle, Request
from libs.member.loop import ComputeLoop
from libs.member.service import MemberConfig, MemberService
from libs.member.stats import Counters
from libs.member.timeouts import TIMEOUTS
from libs.rpc.handlers import RpcError
from pdmesh.v1 import common_pb2 as cpb

DECODE = cpb.PeerRef(name="decode-0", epoch=7)


def key(i: int = 1) -> RoomKey:
    return RoomKey(bytes([i]) * 16, i)


@dataclass(eq=False, kw_only=True)
class Held(Request):
    @property
    def peer_ref(self) -> cpb.PeerRef:
        return DECODE


def held(table: RoomTable, i: int = 1, deadline: float = 60.0) -> Held:
    room = table.create(key(i), deadline=time.monotonic() + deadline)
    return Held(key=key(i), room=room, pages=[1, 2, 3])


class Span:
    def __init__(self) -> None:
        self.attributes: dict = {}
        self.events: list[str] = []

    def set_attribute(self, name, value) -> None:
        self.attributes[name] = value

    def set_status(self, status) -> None:
        self.status = status

    def add_event(self, name, attributes=None) -> None:
        self.events.append(name)


class Ending:
    """A Lifecycle over one held request, with a release that records it ran."""

    def __init__(self, release_takes: float = 0.0, deadline: float = 60.0) -> None:
        self.table = RoomTable(8)
        self.request = held(self.table, deadline=deadline)
        self.counters = Counters()
        self.span = Span()
        self.released_at: float | None = None
        self.release_takes = release_takes

    async def release(self) -> str:
        await anyio.sleep(self.release_takes)  # an await: only a shield lets it finish
        self.released_at = time.monotonic()
        return "released"

    def lifecycle(self, bound: float = 1.0) -> Lifecycle:
        return Lifecycle(self.request, self.counters, self.span,
                         deadline=self.request.room.deadline, release=self.release, bound=bound)


async def test_a_request_that_ends_well_is_released_and_not_counted():
    e = Ending()
    async with e.lifecycle() as life:
        with e.request.scope:
            pass
        assert life.aborted() is None
    assert e.released_at is not None and e.span.events == ["released"]
    assert e.request.room.state is not RoomState.FAILED and not e.counters.aborts


async def test_a_typed_failure_fails_the_room_with_its_own_cause():
    e = Ending()
    with pytest.raises(RpcError):
        async with e.lifecycle() as life:
            life.fail(FailureCause.TRANSFER_ERROR)
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "KV transfer failed")
    assert e.request.room.failure_cause is FailureCause.TRANSFER_ERROR  # not internal
    assert e.counters.aborts == {"transfer_error": 1}
    assert e.released_at is not None


async def test_an_unexpected_error_is_internal():
    e = Ending()
    with pytest.raises(RuntimeError):
        async with e.lifecycle():
            raise RuntimeError("boom")
    assert e.request.room.failure_cause is FailureCause.INTERNAL
    assert e.counters.aborts == {"internal": 1}


@pytest.mark.parametrize(("deadline", "cause", "expired"), [
    (60.0, FailureCause.CLIENT_DISCONNECT, 0),  # cancelled early: the caller left
    (0.05, FailureCause.DEADLINE, 1),  # cancelled once the call's deadline passed
])
async def test_a_cancelled_handler_is_counted_by_when_and_still_releases(deadline, cause,
                                                                          expired):
    e = Ending(release_takes=0.05, deadline=deadline)
    with anyio.move_on_after(0.1):
        async with e.lifecycle():
            await anyio.sleep(10)
    assert e.request.room.failure_cause is cause
    assert e.counters.deadline_expired_total == expired
    assert e.released_at is not None  # shielded: the cancelled scope did not stop it


async def test_a_release_that_hangs_is_cut_short_at_its_bound():
    e = Ending(release_takes=10)
    started = time.monotonic()
    async with e.lifecycle(bound=0.1):
        pass
    assert time.monotonic() - started < 2
    assert e.released_at is None and e.span.events == ["released"]


async def test_an_abort_from_outside_reports_its_first_reason_and_stage():
    e = Ending()
    with pytest.raises(RpcError):
        async with e.lifecycle() as life:
            with e.request.scope:
                e.request.cancel(FailureCause.PEER_LOST, "prefill")
                e.request.cancel(FailureCause.CLIENT_DISCONNECT, "transfer")  # too late
                await anyio.sleep(10)
            cause = life.aborted()
            raise RpcError(grpc.StatusCode.ABORTED, f"aborted: {cause}")
    assert cause is FailureCause.PEER_LOST
    assert e.request.room.failure_cause is FailureCause.PEER_LOST
    assert e.request.abort_stage == "prefill"
    assert e.span.attributes["pdmesh.abort.stage"] == "prefill"


# ---- the Abort skeleton ----------------------------------------------------------------


class Idle(ComputeLoop):
    def busy(self) -> bool:
        return False


class Service(MemberService):
    """A prefill-shaped member whose Abort stops a request by cancelling it."""

    role, role_name = cpb.PREFILL, "prefill"
    release_seconds = 1.0

    def __init__(self) -> None:
        member = SimpleNamespace(name="prefill-0", on_peer_lost=[], pinned_after=30.0,
                                 pool=SimpleNamespace(used=0, num_pages=8))
        super().__init__(member, MemberConfig(max_rooms=8), lambda: 3, Idle(30.0))
        self.stopped: list[tuple[FailureCause, str]] = []

    async def _stop(self, request: Request, reason: FailureCause, abort: cpb.Abort) -> None:
        self.stopped.append((reason, abort.stage))
        request.cancel(reason, abort.stage)

    def on_peer_lost(self, member, reason: str) -> None:
        pass


class Refused(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Refused(code, message)


def abort(i: int = 1, reason: str = "client_disconnect", **ends) -> cpb.Abort:
    return cpb.Abort(key=cpb.RoomKey(room=key(i).room, generation=i), reason=reason,
                     stage="transfer", **ends)


async def test_an_abort_for_an_unknown_room_is_acknowledged_and_remembered():
    service = Service()
    ack = await service.Abort(abort(), Context())
    assert not ack.known and ack.released
    assert key() in service.ended  # a leg that arrives after it is refused


async def test_an_abort_stops_the_request_and_acks_once_its_release_event_is_set():
    service = Service()
    request = service.requests[key()] = held(service.table)

    async def release_soon() -> None:
        await anyio.sleep(0.05)
        request.released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_soon)
        started = time.monotonic()
        ack = await service.Abort(abort(prefill=service.ref(), decode=DECODE), Context())
    assert ack.known and ack.released and time.monotonic() - started < 1
    assert service.stopped == [(FailureCause.CLIENT_DISCONNECT, "transfer")]
    assert request.scope.cancel_called and key() in service.ended


async def test_an_abort_gives_up_waiting_at_the_abort_wait(monkeypatch):
    short = dataclasses.replace(TIMEOUTS, fence_seconds=0.1, prefill_release_seconds=0.2,
                                decode_release_seconds=0.1, abort_wait_seconds=0.2,
                                writer_abort_seconds=0.3)
    monkeypatch.setattr(member_service, "TIMEOUTS", short)
    service = Service()
    service.requests[key()] = held(service.table)  # its release never comes
    started = time.monotonic()
    ack = await service.Abort(abort(), Context())
    assert ack.known and not ack.released
    assert 0.2 <= time.monotonic() - started < 2


@pytest.mark.parametrize("ends", [
    {"prefill": cpb.PeerRef(name="prefill-0", epoch=2)},  # another life of this member
    {"decode": cpb.PeerRef(name="decode-1", epoch=7)},  # another pair's room
])
async def test_an_abort_for_another_life_or_pair_is_refused_and_touches_nothing(ends):
    service = Service()
    request = service.requests[key()] = held(service.table)
    with pytest.raises(Refused) as refused:
        await service.Abort(abort(**ends), Context())
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert not service.stopped and not request.scope.cancel_called
    assert key() not in service.ended


async def test_an_abort_with_an_unknown_reason_is_invalid():
    with pytest.raises(Refused) as refused:
        await Service().Abort(abort(reason="bored"), Context())
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT


async def test_stats_count_the_held_requests_and_name_their_peer():
    service = Service()
    service.requests[key()] = held(service.table)
    stats = await service.Stats(cpb.StatsRequest(), Context())
    assert stats.role == cpb.PREFILL and stats.epoch == 3 and stats.healthy
    assert stats.inflight == 1 and stats.rooms == {"bootstrapping": 1}
    assert service._peer_name(key()) == "decode-0"
