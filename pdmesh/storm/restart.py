"""Mode `restart` (field report incident 3: one role restarted many times under load).

N workers send requests back to back (not cancelled) while the storm SIGKILLs a member
of the --target role --restarts times. The mesh must run under `pdmesh up` on this
host: its supervisor restarts the killed child (backoff 0.5 s doubling to 10 s), so the
storm waits for the member to be back (same name, new epoch, healthy) instead of a fixed
period, then --interval s of load before the next kill. After the last one, --settle s
of load. Per kill: SIGKILL-to-back, outcomes of the requests that ended in its window,
and kill-to-fail of the requests in flight at the kill that failed (how long a client
waited to learn; incident 3's clients waited 35 s). Checks: every restart recovered,
kill-to-fail within --fail-budget, every request around the settle period succeeded,
the surviving role's transfer_failed did not grow during it, and the surviving role was
never restarted (same epochs and pids from start to end): stale registrations of a
restarted peer must not poison the one that stayed up.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field

import anyio
import grpc

from pdmesh.client import GenerateClient
from pdmesh.status import collect
from pdmesh.storm.common import (
    Timeline,
    complete,
    error_kind,
    kv_members,
    ms,
    transfer_failed,
    words,
)

ERROR_PAUSE = 0.1  # a worker's pause after a failure: no hot loop while a member is down


@dataclass
class Load:
    """The continuous load's record: one entry per request, times are monotonic."""

    records: list[dict] = field(default_factory=list)
    details: dict[str, list[str]] = field(default_factory=dict)
    stop: anyio.Event = field(default_factory=anyio.Event)

    def note(self, kind: str, detail: str) -> None:
        seen = self.details.setdefault(kind, [])
        if len(seen) < 3 and detail not in seen:
            seen.append(detail[:200])


async def worker(client: GenerateClient, args, index: int, load: Load) -> None:
    rng = random.Random(args.seed * 1_000_003 + index)
    while not load.stop.is_set():
        messages = [{"role": "user", "content": f"{index} {words(rng, args.prompt_words)}"}]
        start = time.monotonic()
        try:
            ids, _, _ = await complete(client, messages, args.max_tokens)
            kind = "completed" if ids else "completed_without_tokens"
        except grpc.aio.AioRpcError as e:
            kind = error_kind(e)
            load.note(kind, e.details() or "")
        load.records.append({"start": start, "end": time.monotonic(), "kind": kind})
        if kind != "completed":
            await anyio.sleep(ERROR_PAUSE)


def survivors(status: dict, target: str) -> dict[str, tuple[int, int | None]]:
    """name -> (epoch, pid) of the role that is never killed."""
    return {m["name"]: (m["epoch"], m["pid"]) for m in kv_members(status)
            if m["role"] != target}


async def victim(args, index: int) -> dict | None:
    """The target member to kill next (round robin by name), once every one is healthy;
    None if none is within --recover-timeout (or none reports its pid)."""
    deadline = time.monotonic() + args.recover_timeout
    while time.monotonic() < deadline:
        rows = [m for m in kv_members(await collect(args.bootstrap)) if m["role"] == args.target]
        if rows and all(m["healthy"] and m["pid"] for m in rows):
            return sorted(rows, key=lambda m: m["name"])[index % len(rows)]
        await anyio.sleep(0.1)
    return None


async def back(args, old: dict, killed: float) -> dict | None:
    """The member's next life (same name, new epoch, healthy), or None past the timeout."""
    while time.monotonic() - killed < args.recover_timeout:
        for m in kv_members(await collect(args.bootstrap)):
            if m["name"] == old["name"] and m["epoch"] != old["epoch"] and m["healthy"]:
                return m
        await anyio.sleep(0.05)
    return None


async def kill_one(args, index: int) -> dict | None:
    old = await victim(args, index)
    if old is None:
        print(f"kill {index + 1}/{args.restarts}: no healthy {args.target} with a pid to kill "
              f"within {args.recover_timeout} s", flush=True)
        return None
    os.kill(old["pid"], signal.SIGKILL)
    killed = time.monotonic()
    new = await back(args, old, killed)
    recovered = None if new is None else time.monotonic() - killed
    print(f"kill {index + 1}/{args.restarts}: {old['name']} pid {old['pid']} -> "
          + (f"back in {recovered:.1f} s as pid {new['pid']}, new epoch" if new else
             f"NOT back within {args.recover_timeout} s"), flush=True)
    return {"name": old["name"], "pid": old["pid"], "epoch": old["epoch"], "killed": killed,
            "back_s": recovered, "new_epoch": new and new["epoch"], "new_pid": new and new["pid"]}


def window(kill: dict, end: float, records: list[dict]) -> None:
    """Attribute to `kill` the requests that ended between it and `end`, and the
    kill-to-fail of those that were in flight at the kill and failed."""
    t = kill["killed"]
    outcomes: dict[str, int] = {}
    for r in records:
        if t <= r["end"] < end:
            outcomes[r["kind"]] = outcomes.get(r["kind"], 0) + 1
    hit = [r for r in records if r["start"] < t <= r["end"]]
    kill["outcomes"] = outcomes
    kill["inflight_at_kill"] = len(hit)
    kill["kill_to_fail_s"] = sorted(round(r["end"] - t, 3) for r in hit
                                    if r["kind"] != "completed")


async def kills_and_settle(args, load: Load) -> dict:
    """The kill loop, then the settle period; the load runs all along."""
    await anyio.sleep(args.interval)  # load on before the first kill
    kills = []
    for i in range(args.restarts):
        kill = await kill_one(args, i)
        if kill is None:
            break
        kills.append(kill)
        if kill["back_s"] is None:
            break
        await anyio.sleep(args.interval)
    settle_start = time.monotonic()
    print(f"settle: {args.settle} s of load", flush=True)
    failed_before = transfer_failed(await collect(args.bootstrap), _survivor_role(args))
    await anyio.sleep(args.settle)
    load.stop.set()
    return {"kills": kills, "settle_start": settle_start, "failed_before": failed_before}


def _survivor_role(args) -> str:
    return "prefill" if args.target == "decode" else "decode"


def _settle_figures(args, load: Load, settle_start: float, before: int, after: int) -> dict:
    settled = [r for r in load.records if r["end"] >= settle_start]
    outcomes: dict[str, int] = {}
    for r in settled:
        outcomes[r["kind"]] = outcomes.get(r["kind"], 0) + 1
    return {"outcomes": outcomes, "requests": len(settled),
            f"{_survivor_role(args)}_transfer_failed": [before, after]}


async def run(args, timeline: Timeline) -> dict:
    start = await collect(args.bootstrap)
    load = Load()
    async with GenerateClient(args.router, timeout=args.request_timeout) as client:
        async with anyio.create_task_group() as tg:
            for i in range(args.concurrency):
                tg.start_soon(worker, client, args, i, load)
            phase = await kills_and_settle(args, load)
    end = await collect(args.bootstrap)
    kills = phase["kills"]
    bounds = [k["killed"] for k in kills[1:]] + [phase["settle_start"]]
    for kill, until in zip(kills, bounds, strict=True):
        window(kill, until, load.records)
    settle = _settle_figures(args, load, phase["settle_start"], phase["failed_before"],
                             transfer_failed(end, _survivor_role(args)))
    return summarize(args, start, end, kills, settle, load, timeline)


def summarize(args, start: dict, end: dict, kills: list[dict], settle: dict, load: Load,
              timeline: Timeline) -> dict:
    role = _survivor_role(args)
    recovered = [k for k in kills if k["back_s"] is not None]
    to_fail = [s for k in kills for s in k["kill_to_fail_s"]]
    names = set(survivors(start, args.target))
    epochs = {(n, e) for r in timeline.rows for n, e in r.get("epochs", {}).items() if n in names}
    outcomes: dict[str, int] = {}
    for r in load.records:
        outcomes[r["kind"]] = outcomes.get(r["kind"], 0) + 1
    back_s = [k["back_s"] for k in recovered]
    for k in kills:
        k["t"] = round(k["killed"] - timeline.started, 3)  # on the timeline's clock
    xfail = settle[f"{role}_transfer_failed"]
    print(f"requests: {outcomes}\nfailure details: {load.details}")
    print(f"restarts: {len(recovered)}/{args.restarts} back (SIGKILL to new epoch healthy: "
          f"{', '.join(f'{s:.1f}' for s in back_s)} s)")
    print(f"kill-to-fail of {len(to_fail)} in-flight requests that failed: max "
          f"{ms(max(to_fail) if to_fail else 0)}; in flight per kill "
          f"{[k['inflight_at_kill'] for k in kills]}")
    print(f"settle: {settle['outcomes']}; {role} transfer_failed {xfail[0]} -> {xfail[1]}")
    settled_ok = settle["requests"] > 0 and set(settle["outcomes"]) == {"completed"}
    return {
        "figures": {"kills": kills, "settle": settle, "failure_details": load.details,
                    "kill_to_fail_max_s": max(to_fail) if to_fail else None,
                    "survivors_start": survivors(start, args.target),
                    "survivors_end": survivors(end, args.target),
                    "requests": [[round(r["start"] - timeline.started, 3),
                                  round(r["end"] - timeline.started, 3), r["kind"]]
                                 for r in load.records]},
        "outcomes": outcomes,
        "checks": [
            (f"{args.restarts} {args.target} restarts, each back with a new epoch "
             f"within {args.recover_timeout} s", len(recovered) == args.restarts),
            (f"in-flight requests failed within {args.fail_budget} s of the kill",
             all(s <= args.fail_budget for s in to_fail)),
            ("every request of the settle period succeeded", settled_ok),
            (f"no request hung until its {args.request_timeout} s client timeout",
             not outcomes.get("error:DEADLINE_EXCEEDED")),
            (f"{role} transfer_failed did not grow during the settle period",
             xfail[1] <= xfail[0]),
            (f"{role} never restarted (same epochs and pids from start to end)",
             survivors(start, args.target) == survivors(end, args.target)
             and len(epochs) == len(names)),
        ],
    }
