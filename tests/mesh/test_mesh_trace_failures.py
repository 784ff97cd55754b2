"""Traces of requests that end early on a mesh whose prefill compute thread is slow
(every forward pass first sleeps STALL seconds): a client that leaves while its request
waits in the prefill's queue, a deadline that passes during the prefill, and a prefill
killed mid-request. Each trace names the reason and the stage on every service that
lived to export its spans."""

from __future__ import annotations

import os
import signal

import anyio
import grpc
import pytest

from pdmesh.localmesh import start_mesh, wait_quiet
from tests.mesh.otlp import ERROR, by_service, roots_since, run, serve_receiver, settled_trace

STALL = 1.0
PROMPT = "river engine " * 10


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    receiver, server, env = serve_receiver()
    # No retry: a failed attempt's trace is the request's trace.
    mesh = start_mesh(tmp_path_factory.mktemp("stalled"), model="tiny", extra_env=env,
                      up_args=["--faults", f"stall_forward={STALL}",
                               "--router-args", "--retries 0"])
    yield mesh, receiver
    mesh.stop()
    server.stop(0)


def aborted(span: dict, reason: str, stage: str | None = None) -> bool:
    attributes = span["attributes"]
    return (span["status"] == ERROR and attributes.get("pdmesh.abort.reason") == reason
            and (stage is None or attributes.get("pdmesh.abort.stage") == stage))


async def test_a_client_that_leaves_while_queued_ends_its_spans_as_queued(stalled):
    mesh, receiver = stalled
    before = len(roots_since(receiver, 0, 0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, mesh, PROMPT, 4)  # its forward pass holds the compute thread
        await anyio.sleep(0.3)
        await run(mesh, "queued " * 20, 4, cancel_after=0.4)  # waits behind it, then leaves
    roots = roots_since(receiver, 0, before + 2)[before:]
    (root,) = [r for r in roots if r["status"] == ERROR]
    spans = settled_trace(receiver, root, {"pdmesh-router", "pdmesh-prefill", "pdmesh-decode"})
    for s in (root, by_service(spans, "pdmesh-decode", "decode"),
              by_service(spans, "pdmesh-prefill", "prefill")):
        assert aborted(s, "client_disconnect", "queued"), s
    assert by_service(spans, "pdmesh-decode", "kv wait")["status"] == ERROR  # no KV came
    # it never reached the model: no chunk of it was computed
    assert not [s for s in spans if s["name"] == "prefill chunk" and s["status"] != ERROR]
    await anyio.to_thread.run_sync(wait_quiet, mesh, 5.0)


async def test_a_deadline_during_the_prefill_ends_the_spans_as_deadline(stalled):
    mesh, receiver = stalled
    before = len(roots_since(receiver, 0, 0))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run(mesh, PROMPT, 4, timeout=0.7)  # the forward pass alone takes STALL
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    root = roots_since(receiver, 0, before + 1)[-1]
    spans = settled_trace(receiver, root, {"pdmesh-router", "pdmesh-prefill", "pdmesh-decode"})
    assert aborted(root, "deadline", "prefill"), root
    assert aborted(by_service(spans, "pdmesh-prefill", "prefill"), "deadline", "prefill")
    # The decode's KV wait ends a little before the deadline, on its own clock; it can
    # only know the request was still upstream of it.
    assert aborted(by_service(spans, "pdmesh-decode", "decode"), "deadline")
    await anyio.to_thread.run_sync(wait_quiet, mesh, 5.0)


async def test_a_prefill_killed_mid_request_ends_the_spans_as_peer_lost(stalled):
    """Last in the module: the supervisor restarts the killed prefill."""
    mesh, receiver = stalled
    before = len(roots_since(receiver, 0, 0))
    prefill_pid = mesh.pid_of("prefill")

    async def kill_during_the_forward_pass() -> None:
        await anyio.sleep(0.4)
        os.kill(prefill_pid, signal.SIGKILL)

    error = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_during_the_forward_pass)
        try:
            await run(mesh, PROMPT, 4)
        except grpc.aio.AioRpcError as e:
            error = e
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    root = roots_since(receiver, 0, before + 1)[-1]
    # the killed prefill exported nothing more; the router and the decode tell the story
    spans = settled_trace(receiver, root, {"pdmesh-router", "pdmesh-decode"})
    assert aborted(root, "peer_lost", "prefill"), root
    assert aborted(by_service(spans, "pdmesh-decode", "decode"), "peer_lost", "prefill")
    assert by_service(spans, "pdmesh-router", "prefill call")["status"] == ERROR
