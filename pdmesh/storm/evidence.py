"""When a storm fails to quiesce: who still holds what, and where its requests wait.

The timeline sums over members, which says that something is stuck but not where. On a
failed quiescence check the storm prints each busy member's counters and the stacks of
the request handlers still running on the router and on every busy member (from
Admin.Dump), so a failure seen once, in CI or in the field, can be read afterwards.
"""

from __future__ import annotations

import anyio
import grpc

from pdmesh.status import collect, dump_member
from pdmesh.storm.common import kv_members

# Frames that mark a task as one request's handler (not a service's own loop).
HANDLER_FRAMES = (", in Generate\n", ", in Prefill\n", ", in _generate\n", ", in _prefill\n")
STACK_LINES = 24  # the innermost lines of each stack: where it waits


def _is_request(dump) -> bool:
    """A request handler's chain, or a router generator a request runs through."""
    if "/services/" not in dump.stack or ", in Dump\n" in dump.stack:
        return False
    return (any(marker in dump.stack for marker in HANDLER_FRAMES)
            or dump.name.startswith("async generator "))


def _handler_stacks(reply) -> list[str]:
    out = []
    for task in reply.tasks:
        if _is_request(task):
            lines = task.stack.rstrip().splitlines()
            out.append("\n".join([lines[0], *lines[1:][-STACK_LINES:]]))
    return out


async def busy_evidence(bootstrap: str, timeout: float = 10.0) -> dict:
    """Busy members' counters and the handler stacks of the router and of each of them."""
    evidence: dict = {"members": [], "stacks": {}}
    with anyio.move_on_after(timeout):
        try:
            status = await collect(bootstrap)
        except grpc.aio.AioRpcError as e:
            return {"error": f"status: {e.code().name}"}
        busy = [m for m in kv_members(status) if m["inflight"] or m["kv_pages_used"]]
        evidence["members"] = [
            {key: m.get(key) for key in ("name", "role", "epoch", "inflight", "kv_pages_used",
                                          "rooms", "aborts_by_reason")}
            for m in busy
        ]
        routers = [m["name"] for m in status["members"] if m["role"] == "router"]
        for name in [*routers, *(m["name"] for m in busy)]:
            try:
                reply = await dump_member(bootstrap, name)
            except (grpc.aio.AioRpcError, LookupError) as e:
                evidence["stacks"][name] = [f"dump failed: {e}"]
                continue
            evidence["stacks"][name] = _handler_stacks(reply)
    return evidence


def render(evidence: dict) -> str:
    if "error" in evidence:
        return f"evidence unavailable: {evidence['error']}"
    lines = ["still busy:"]
    for m in evidence["members"]:
        lines.append(f"  {m['role']} {m['name']}: inflight {m['inflight']}, "
                     f"{m['kv_pages_used']} KV pages, rooms {m['rooms'] or {}}")
    for name, stacks in evidence["stacks"].items():
        lines.append(f"  {name}: {len(stacks)} request chain(s)")
        for stack in stacks:
            lines.extend("    " + line for line in stack.splitlines())
    return "\n".join(lines)
