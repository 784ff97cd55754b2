"""One fault during an abort storm, and what the mesh did about it.

The storm: workers send greedy chat requests back to back over a few fixed
conversations; half are cancelled by their client at a random time (the aborts), half
run to the end and must equal the tokens the same conversation got before any fault
(the agentic replay: a request that read another's KV, or lost some of its own, differs).
A fault is applied one second in, held, cleared; the storm stops when it clears (its
requests in flight are cancelled: more aborts). Then: how long until every prefill and
decode is back to inflight 0 and 0 KV pages, how long until a request is served
correctly again, a replay of every conversation, and whether any process other than a
killed one was restarted.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass

import anyio
import grpc

from bench.netfaults.world import World
from libs.rpc.calls import close_channel, open_channel, unary
from pdmesh.client import GenerateClient
from pdmesh.status import collect, member_stats
from pdmesh.storm.common import cancel_after, complete, error_kind, is_quiet, words
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb

CONVERSATIONS = 4
MAX_TOKENS = 16
WORKERS = 6
FAULT_AT = 1.0  # seconds into the storm


@dataclass(frozen=True)
class Fault:
    name: str  # the table's row
    kind: str  # cut | loss | delay | partition | freeze | kill
    target: str
    hold: float  # seconds the fault lasts (kill: the storm goes on while it reloads)


FAULTS = (
    Fault("link cut (prefill), mid-transfer", "cut", "prefill", 3.0),
    Fault("loss 20% (decode link)", "loss", "decode", 3.0),
    Fault("delay 100 ms (decode link)", "delay", "decode", 3.0),
    Fault("decode frozen (SIGSTOP)", "freeze", "decode", 4.0),
    Fault("prefill killed (SIGKILL, restarted)", "kill", "prefill", 3.0),
    Fault("partition decode / bootstrap only", "partition", "decode", 4.0),
)


def conversation(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"conversation {k}: "
             f"{words(random.Random(k), 24)}"}]


async def answers(client: GenerateClient) -> list[list[int] | str]:
    """Each conversation's greedy tokens, or the error that ended it."""
    out: list[list[int] | str] = []
    for k in range(CONVERSATIONS):
        try:
            out.append((await complete(client, conversation(k), MAX_TOKENS))[0])
        except grpc.aio.AioRpcError as e:
            out.append(e.code().name)
    return out


async def wait_ready(client: GenerateClient, world: World, baseline, limit: float) -> float | None:
    """Seconds until every service is registered and a request is answered with the
    baseline's tokens (None: not within `limit`)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            status = await collect(world.bootstrap, timeout=1.0)
            roles = {m["role"] for m in status["members"] if m.get("healthy")
                     or m["role"] == "router"}
            if {"prefill", "decode", "router"} <= roles:
                ids = (await complete(client, conversation(0), MAX_TOKENS))[0]
                if baseline is None or ids == baseline[0]:
                    return time.monotonic() - started
        except grpc.aio.AioRpcError:
            pass
        await anyio.sleep(0.1)
    return None


class Storm:
    def __init__(self, client: GenerateClient, baseline: list) -> None:
        self.client = client
        self.baseline = baseline
        self.counts = {"requests": 0, "aborted": 0, "failed": 0, "completed": 0,
                       "corrupt": 0}
        self.errors: dict[str, int] = {}

    async def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            k = rng.randrange(CONVERSATIONS)
            self.counts["requests"] += 1
            try:
                if rng.random() < 0.5:
                    outcome = await cancel_after(self.client, rng.uniform(0.05, 0.5),
                                                 messages=conversation(k), max_tokens=64)
                    if outcome.startswith("cancelled"):
                        self.counts["aborted"] += 1
                    elif outcome == "completed":
                        self.counts["completed"] += 1
                    else:
                        self._failed(outcome)
                else:
                    ids = (await complete(self.client, conversation(k), MAX_TOKENS))[0]
                    self.counts["completed"] += 1
                    if ids != self.baseline[k]:
                        self.counts["corrupt"] += 1
            except grpc.aio.AioRpcError as e:
                self._failed(error_kind(e))
                await anyio.sleep(0.05)  # a client backs off a little after a failure
            except anyio.get_cancelled_exc_class():
                self.counts["aborted"] += 1  # in flight when the storm stopped: cancelled
                raise

    def _failed(self, why: str) -> None:
        self.counts["failed"] += 1
        self.errors[why] = self.errors.get(why, 0) + 1


class Sampler:
    """Status every 0.2 s: the most pinned rooms seen."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pinned = 0
        self.samples = 0

    async def run(self) -> None:
        while True:
            try:
                status = await collect(self.world.bootstrap, timeout=1.0)
            except grpc.aio.AioRpcError:
                await anyio.sleep(0.2)
                continue
            self.samples += 1
            self.pinned = max(self.pinned, sum(len(m["pinned"]) for m in status["members"]))
            await anyio.sleep(0.2)


async def peers_failed_rooms(world: World, frozen: str, since: float, limit: float,
                             ) -> float | None:
    """Seconds from `since` until `frozen` is out of the registry and the members of the
    other KV role hold no room: its rooms failed on its peers. Asks the bootstrap and
    those peers only, every 50 ms (a frozen member would hold a full status up)."""
    peer_role = cpb.PREFILL if frozen == "decode" else cpb.DECODE
    frozen_role = cpb.DECODE if frozen == "decode" else cpb.PREFILL
    while time.monotonic() - since < limit:
        channel = open_channel(world.bootstrap)
        try:
            members = (await unary(bgrpc.BootstrapStub(channel).ListMembers,
                                   bpb.ListMembersRequest(), timeout=1.0)).members
        except grpc.aio.AioRpcError:
            members = None
        finally:
            await close_channel(channel)
        if members is not None and not any(m.role == frozen_role for m in members):
            peers = [await member_stats(m, 0.5) for m in members if m.role == peer_role]
            if peers and all(p["inflight"] == 0 for p in peers):
                return time.monotonic() - since
        await anyio.sleep(0.05)
    return None


async def quiet_after(world: World, since: float, limit: float,
                      busy: list[dict]) -> float | None:
    """Seconds from `since` until every prefill and decode answers inflight 0 and 0 KV
    pages; None after `limit`, with the members still busy then in `busy` (evidence)."""
    while time.monotonic() - since < limit:
        try:
            status = await collect(world.bootstrap, timeout=1.0)
            kv = [m for m in status["members"] if m["role"] in ("prefill", "decode")]
            if kv and all(m["inflight"] is not None for m in kv) and is_quiet(status):
                return time.monotonic() - since
            busy[:] = [{k: m.get(k) for k in ("name", "epoch", "inflight", "kv_pages_used",
                                              "rooms", "pinned", "error")}
                       for m in kv if m["inflight"] or m["kv_pages_used"] or m.get("error")]
        except grpc.aio.AioRpcError:
            pass
        await anyio.sleep(0.05)
    return None


async def kv_bytes_moved(world: World) -> int:
    """KV bytes the prefills wrote into decodes so far (this life of each member)."""
    status = await collect(world.bootstrap, timeout=1.0)
    return sum(m["kv_transfer_bytes_moved_total"] or 0 for m in status["members"]
               if m["role"] == "prefill")


async def prefill_rooms(world: World) -> int:
    """Rooms the prefills hold now: requests whose KV is being computed and written."""
    status = await collect(world.bootstrap, timeout=1.0)
    return sum(m["inflight"] or 0 for m in status["members"] if m["role"] == "prefill")


async def run(world: World, client: GenerateClient, fault: Fault, baseline: list) -> dict:
    """Run one fault; returns the row (figures and checks). A fault this world cannot make
    returns {"skipped": why}."""
    pids = world.pids()
    moved_before = await kv_bytes_moved(world)
    storm, sampler = Storm(client, baseline), Sampler(world)
    applied_at = cleared_at = 0.0
    frozen_failed: float | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler.run)
        for seed in range(WORKERS):
            tg.start_soon(storm.worker, seed)
        await anyio.sleep(FAULT_AT)
        rooms_at_fault = await prefill_rooms(world)
        applied_at = time.monotonic()
        if fault.kind == "freeze":
            world.signal(fault.target, signal.SIGSTOP)
            frozen_failed = await peers_failed_rooms(world, fault.target, applied_at,
                                                     fault.hold)
        elif fault.kind == "kill":
            world.kill_and_restart(fault.target)
        elif world.apply(fault.kind, fault.target) is None:
            tg.cancel_scope.cancel()
            return {"fault": fault.name, "skipped": world.unsupported.get(fault.kind, "")}
        await anyio.sleep(max(0.0, applied_at + fault.hold - time.monotonic()))
        if fault.kind == "freeze":
            world.signal(fault.target, signal.SIGCONT)
        elif fault.kind != "kill":
            world.clear(fault.kind, fault.target)
        cleared_at = time.monotonic()
        tg.cancel_scope.cancel()  # the storm ends with the fault: its requests are cancelled
    budget = world.request_timeout + 1.0
    busy: list[dict] = []
    waited: dict[str, float | None] = {}

    async def quiet() -> None:
        waited["quiet"] = await quiet_after(world, cleared_at, budget + 30, busy)

    async def restored() -> None:  # beside the wait for quiet: a wedge must not hide it
        ready = await wait_ready(client, world, baseline, 60)
        waited["recovery"] = None if ready is None else time.monotonic() - cleared_at

    async with anyio.create_task_group() as tg:
        tg.start_soon(quiet)
        tg.start_soon(restored)
    quiet_s, recovery = waited["quiet"], waited["recovery"]
    replay = await answers(client)
    moved = await kv_bytes_moved(world) - (0 if fault.kind == "kill" else moved_before)
    restarted = [r for r, pid in pids.items()
                 if r != (fault.target if fault.kind == "kill" else None)
                 and (world.pids()[r] != pid or not world.alive(r))]
    row = {
        "fault": fault.name, **storm.counts, "errors": storm.errors, "pinned": sampler.pinned,
        "samples": sampler.samples, "quiet_s": quiet_s, "recovery_s": recovery,
        "replay_corrupt": sum(r != b for r, b in zip(replay, baseline, strict=True)),
        "restarted": restarted, "frozen_rooms_failed_s": frozen_failed,
        "kv_bytes_moved": moved, "prefill_rooms_at_fault": rooms_at_fault,
        "busy_after": [] if quiet_s is not None else busy,
    }
    checks = {
        "0 pinned rooms": sampler.pinned == 0,
        "0 corrupt (storm and replay)": storm.counts["corrupt"] == 0
        and row["replay_corrupt"] == 0,
        f"inflight 0 within deadline + 1 s ({budget:g} s) after it cleared":
            quiet_s is not None and quiet_s <= budget,
        "healthy members never restarted": not restarted,
        "service restored": recovery is not None,
        "requests were aborted": storm.counts["aborted"] > 0,
        "KV moved between the members": moved > 0,
        "transfers in flight when the fault hit": rooms_at_fault > 0,
    }
    if fault.kind == "freeze":
        checks[f"frozen member's rooms failed on its peers within the lease "
               f"({world.lease:g} s + 1 s)"] = (frozen_failed is not None
                                               and frozen_failed <= world.lease + 1.0)
    row["checks"] = checks
    row["passed"] = all(checks.values())
    return row
