"""`pdmesh status`: the bootstrap's members and each member's live counters."""

from __future__ import annotations

import json

import anyio
import grpc

from libs.rpc.calls import close_channel, open_channel, unary
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb
from pdmesh.v1 import common_pb2_grpc as cgrpc

ROLE_NAMES = {cpb.PREFILL: "prefill", cpb.DECODE: "decode", cpb.ROUTER: "router"}


async def member_stats(member: bpb.Member, timeout: float) -> dict:
    row = {
        "role": ROLE_NAMES.get(member.role, "unknown"),
        "name": member.name,
        "epoch": member.epoch,
        "address": member.address,
        "metrics": f"http://{member.http_address}/metrics" if member.http_address else None,
        "healthy": False,
        "inflight": None,
        "kv_pages_used": None,
        "kv_pages_total": None,
        "rooms": {},
        "transfer_failed_total": None,
        "aborts_total": None,
        "pinned": [],
        "pid": None,
        "deadline_expired_total": None,
        "aborts_by_reason": {},
        "prompt_tokens_computed_total": None,
        "queue_depth": None,
        "preemptions_total": None,
        "kv_pages_cached": None,
        "prefix_cache_queries_total": None,
        "prefix_cache_query_tokens_total": None,
        "prefix_cache_hits_total": None,
        "prefix_cache_hit_rate": None,
        "kv_transfer_bytes_moved_total": None,
        "kv_transfer_bytes_skipped_total": None,
    }
    channel = open_channel(member.address)
    try:
        stats = await unary(cgrpc.AdminStub(channel).Stats, cpb.StatsRequest(), timeout=timeout)
        row.update(
            healthy=stats.healthy,
            inflight=stats.inflight,
            kv_pages_used=stats.kv_pages_used,
            kv_pages_total=stats.kv_pages_total,
            rooms=dict(stats.rooms),
            transfer_failed_total=stats.transfer_failed_total,
            aborts_total=stats.aborts_total,
            requests_total=stats.requests_total,
            pid=stats.pid or None,
            deadline_expired_total=stats.deadline_expired_total,
            aborts_by_reason=dict(stats.aborts_by_reason),
            prompt_tokens_computed_total=stats.prompt_tokens_computed_total,
            # only a router queues: prefills and decodes admit or refuse at once
            queue_depth=stats.queue_depth if member.role == cpb.ROUTER else None,
            preemptions_total=stats.preemptions_total,
            **_cache_fields(member, stats),
            pinned=[
                {
                    "room": p.room, "generation": p.generation,
                    "state": cpb.RoomState.Name(p.state).lower(),
                    "age_seconds": round(p.age_seconds, 3),
                    "idle_seconds": round(p.idle_seconds, 3), "peer": p.peer,
                }
                for p in stats.pinned
            ],
        )
    except grpc.aio.AioRpcError as e:
        row["error"] = f"{e.code().name}: {e.details()}"
    finally:
        await close_channel(channel)
    return row


def _cache_fields(member: bpb.Member, stats: cpb.MemberStats) -> dict:
    """Prefix cache and KV transfer figures of a prefill or decode (None elsewhere); the
    hit rate is prompt tokens found over prompt tokens looked up."""
    if member.role not in (cpb.PREFILL, cpb.DECODE):
        return {}
    asked = stats.prefix_cache_query_tokens_total
    return dict(
        kv_pages_cached=stats.kv_pages_cached,
        prefix_cache_queries_total=stats.prefix_cache_queries_total,
        prefix_cache_query_tokens_total=asked,
        prefix_cache_hits_total=stats.prefix_cache_hits_total,
        prefix_cache_hit_rate=round(stats.prefix_cache_hits_total / asked, 4) if asked else None,
        kv_transfer_bytes_moved_total=stats.kv_transfer_bytes_moved_total
        if member.role == cpb.PREFILL else None,
        kv_transfer_bytes_skipped_total=stats.kv_transfer_bytes_skipped_total
        if member.role == cpb.PREFILL else None,
    )


async def collect(bootstrap: str, timeout: float = 3.0) -> dict:
    """What `pdmesh status --json` prints (docs/operations.md). `bootstrap` may list
    replicas (host:port,host:port): the first that answers is asked. Raises
    grpc.aio.AioRpcError if none answers."""
    *others, last = [a.strip() for a in bootstrap.split(",") if a.strip()] or [bootstrap]
    for address in others:
        try:
            return await _collect(address, timeout)
        except grpc.aio.AioRpcError:
            continue
    return await _collect(last, timeout)


async def _collect(bootstrap: str, timeout: float) -> dict:
    channel = open_channel(bootstrap)
    try:
        reply = await unary(
            bgrpc.BootstrapStub(channel).ListMembers, bpb.ListMembersRequest(), timeout=timeout
        )
        own = await unary(cgrpc.AdminStub(channel).Stats, cpb.StatsRequest(), timeout=timeout)
    finally:
        await close_channel(channel)
    rows: list[dict] = [{}] * len(reply.members)

    async def fill(i: int, member: bpb.Member) -> None:
        rows[i] = await member_stats(member, timeout)

    async with anyio.create_task_group() as tg:
        for i, member in enumerate(reply.members):
            tg.start_soon(fill, i, member)
    rows.sort(key=lambda r: (r["role"], r["name"]))
    metrics = f"http://{own.metrics_address}/metrics" if own.metrics_address else None
    return {"bootstrap": {"address": bootstrap, "metrics": metrics}, "members": rows}


def render(status: dict) -> str:
    boot = status["bootstrap"]
    metrics = f" (metrics {boot['metrics']})" if boot.get("metrics") else ""
    lines = [f"bootstrap {boot['address']}{metrics}: {len(status['members'])} members"]
    header = f"{'ROLE':8} {'NAME':20} {'HEALTHY':7} {'INFLIGHT':8} {'KV PAGES':13} {'FAILED':6} "
    lines.append(header + "ABORTS  QUEUED CACHED HIT%  ROOMS")
    for m in status["members"]:
        pages = (
            f"{m['kv_pages_used']}/{m['kv_pages_total']}" if m["kv_pages_total"] else "-"
        )
        rooms = ",".join(f"{k}={v}" for k, v in m["rooms"].items()) or "-"
        lines.append(
            f"{m['role']:8} {m['name']:20} {'yes' if m['healthy'] else 'NO':7} "
            f"{_dash(m['inflight']):8} {pages:13} {_dash(m['transfer_failed_total']):6} "
            f"{_dash(m['aborts_total']):7} {_dash(m['queue_depth']):6} "
            f"{_dash(m.get('kv_pages_cached')):6} {_percent(m.get('prefix_cache_hit_rate')):5} "
            f"{rooms}"
            + (f"  ({m['error']})" if "error" in m else "")
        )
    for m in status["members"]:
        for p in m["pinned"]:
            lines.append(
                f"PINNED on {m['name']}: room {p['room'][:12]}/{p['generation']} "
                f"{p['state']} for {p['idle_seconds']:.1f}s (age {p['age_seconds']:.1f}s, "
                f"peer {p['peer'] or '?'})"
            )
    return "\n".join(lines)


async def dump_member(bootstrap: str, name: str, timeout: float = 10.0) -> cpb.DumpReply:
    """Thread and task stacks of the member called `name` ("bootstrap" for the registry)."""
    address = bootstrap
    if name != "bootstrap":
        channel = open_channel(bootstrap)
        try:
            reply = await unary(
                bgrpc.BootstrapStub(channel).ListMembers, bpb.ListMembersRequest(),
                timeout=timeout,
            )
        finally:
            await close_channel(channel)
        found = [m.address for m in reply.members if m.name == name]
        if not found:
            known = ", ".join(sorted(m.name for m in reply.members)) or "none"
            raise LookupError(f"no member named {name!r} (members: {known}, bootstrap)")
        address = found[0]
    channel = open_channel(address)
    try:
        return await unary(cgrpc.AdminStub(channel).Dump, cpb.DumpRequest(), timeout=timeout)
    finally:
        await close_channel(channel)


def render_dump(reply: cpb.DumpReply) -> str:
    parts = [f"# {reply.name} (pid {reply.pid}): {len(reply.threads)} threads, "
             f"{len(reply.tasks)} asyncio tasks"]
    for kind, stacks in (("thread", reply.threads), ("task", reply.tasks)):
        for s in stacks:
            parts.append(f"\n## {kind} {s.name}\n{s.stack.rstrip()}")
    return "\n".join(parts)


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.0f}%"


def _dash(value) -> str:
    return "-" if value is None else str(value)


def to_json(status: dict) -> str:
    return json.dumps(status, indent=2)
