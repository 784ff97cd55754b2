"""Traces across the mesh, received by a real OTLP/gRPC receiver inside the test
(tests/mesh/otlp.py): one trace per request, and every aborted request's spans end as
ERROR with the reason and the stage it was in, on every service it touched."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from pdmesh.localmesh import free_port, start_mesh, wait_quiet
from tests.mesh.otlp import ERROR, by_service, roots_since, run, serve_receiver, settled_trace

# The prefill waits 1 s between computing a chunk and writing it (a window in the prefill
# stage), and 1 s before its final, notifying write (a window in the transfer stage).
FAULTS = "pause_between_chunks=1.0,delay_kv_ready=1.0"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver, server, env = serve_receiver()
    mesh = start_mesh(tmp_path_factory.mktemp("traced"), model="tiny", extra_env=env,
                      up_args=["--faults", FAULTS])
    yield mesh, receiver
    mesh.stop()
    server.stop(0)


async def test_a_request_is_one_trace_across_router_prefill_and_decode(traced):
    mesh, receiver = traced
    before = len(roots_since(receiver, 0, 0))
    assert await run(mesh, "river engine " * 20, 6) == 6
    root = roots_since(receiver, 0, before + 1)[-1]
    spans = settled_trace(receiver, root, {"pdmesh-router", "pdmesh-prefill", "pdmesh-decode"})
    assert root["name"] == "text_completion tiny" and root["status"] != 2
    assert root["attributes"]["gen_ai.request.model"] == "tiny"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    prefill_call = by_service(spans, "pdmesh-router", "prefill call")
    decode_call = by_service(spans, "pdmesh-router", "decode call")
    prefill = by_service(spans, "pdmesh-prefill", "prefill")
    decode = by_service(spans, "pdmesh-decode", "decode")
    assert prefill["parent"] == prefill_call["id"] and decode["parent"] == decode_call["id"]
    assert prefill_call["parent"] == root["id"] and decode_call["parent"] == root["id"]
    transfer = by_service(spans, "pdmesh-prefill", "kv transfer")
    assert transfer["parent"] == prefill["id"]
    assert transfer["attributes"]["pdmesh.kv.bytes"] > 0
    assert transfer["attributes"]["pdmesh.kv.status"] == "ok"
    assert transfer["attributes"]["pdmesh.kv.descriptors"] >= 1
    assert transfer["attributes"]["pdmesh.kv.gbps"] > 0
    assert by_service(spans, "pdmesh-decode", "generate")["parent"] == decode["id"]
    admission = by_service(spans, "pdmesh-decode", "admission")
    assert admission["parent"] == decode["id"] and admission["attributes"]["pdmesh.kv.pages"] > 0
    assert all(s["status"] != 2 for s in spans), [s for s in spans if s["status"] == 2]


async def test_a_client_that_hangs_up_right_after_the_last_token_was_served_not_aborted(
        traced):
    """Closing the channel as soon as the finish arrives cancels the router's handler
    too; the request was served all the same and its trace must say so."""
    mesh, receiver = traced
    before = len(roots_since(receiver, 0, 0))
    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(run, mesh, "river engine " * 10, 3)
    roots = roots_since(receiver, 0, before + 6)[before:]
    assert [r for r in roots if r["status"] == ERROR] == []
    assert all(r["attributes"]["gen_ai.response.finish_reasons"] == ["length"] for r in roots)


@pytest.mark.parametrize(("stage", "prompt_words", "kwargs"), [
    ("prefill", 700, {"cancel_after": 0.3}),  # inside the pause after chunk 1
    ("transfer", 20, {"cancel_after": 0.4}),  # one chunk computed, its write held back
    ("decode", 20, {"after_tokens": 2}),
])
async def test_a_client_disconnect_ends_every_touched_span_as_an_abort(
        traced, stage, prompt_words, kwargs):
    mesh, receiver = traced
    before = len(roots_since(receiver, 0, 0))
    await run(mesh, "river engine " * (prompt_words // 2), 400, **kwargs)
    root = roots_since(receiver, 0, before + 1)[-1]
    involved = {"pdmesh-router", "pdmesh-decode"} | (
        {"pdmesh-prefill"} if stage != "decode" else set())
    spans = settled_trace(receiver, root, involved)
    expected = {"pdmesh.abort.reason": "client_disconnect", "pdmesh.abort.stage": stage}
    server_spans = [root, by_service(spans, "pdmesh-decode", "decode")]
    if stage != "decode":
        server_spans.append(by_service(spans, "pdmesh-prefill", "prefill"))
    for s in server_spans:
        assert s["status"] == ERROR, s
        assert {k: s["attributes"].get(k) for k in expected} == expected, s
    if stage == "transfer":  # the transfer's own span ended inside the cancelled scope
        transfer = by_service(spans, "pdmesh-prefill", "kv transfer")
        assert transfer["status"] == ERROR and "cancelled" in transfer["events"], transfer
    abort = by_service(spans, "pdmesh-router", "abort")
    assert abort["events"].count("AbortAck") >= 1
    # the prefill acknowledged its writes fenced, so the decode frees at once: no quarantine
    assert "released" in by_service(spans, "pdmesh-decode", "decode")["events"]
    await anyio.to_thread.run_sync(wait_quiet, mesh, 3.0)


async def test_pdmesh_up_trace_store_and_pdmesh_traces(tmp_path):
    """No other software: `pdmesh up --trace-store` keeps the spans in SQLite and
    `pdmesh traces` lists the aborted request and prints its tree across the services."""
    db = tmp_path / "traces.sqlite"
    mesh = await anyio.to_thread.run_sync(lambda: start_mesh(
        tmp_path, model="tiny", extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
        up_args=["--trace-store", str(db)]))
    try:
        assert await run(mesh, "river engine " * 10, 4) == 4
        await run(mesh, "river engine " * 10, 400, after_tokens=2)

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "pdmesh.cli", "traces", "--db",
                                   str(db), *args], capture_output=True, text=True, timeout=60)

        deadline = time.monotonic() + 15
        while True:
            aborted = json.loads(cli("--aborted", "--json").stdout or "[]")
            everything = json.loads(cli("--json").stdout or "[]")
            if aborted and len(everything) >= 2:
                break
            assert time.monotonic() < deadline, (aborted, everything)
            await anyio.sleep(0.2)
        (root,) = aborted
        assert root["attributes"]["pdmesh.abort.reason"] == "client_disconnect"
        tree = cli(root["attributes"]["pdmesh.request.id"])
        assert tree.returncode == 0
        assert "pdmesh-decode: decode" in tree.stdout and "pdmesh-prefill: prefill" in tree.stdout
    finally:
        await anyio.to_thread.run_sync(mesh.stop)


async def test_an_unreachable_collector_never_blocks_serving(tmp_path):
    """Every service exports to a port nobody listens on: requests are served as usual
    (the bounded batch queue drops spans; nothing waits on the exporter) and the mesh
    still stops promptly."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    mesh = await anyio.to_thread.run_sync(
        lambda: start_mesh(tmp_path, model="tiny", extra_env=env))
    try:
        for _ in range(5):
            started = time.monotonic()
            assert await run(mesh, "river engine " * 10, 8) == 8
            assert time.monotonic() - started < 2.0
        # ... and every lost span is counted on the service's metrics endpoint
        status = await anyio.to_thread.run_sync(mesh.status)
        urls = [status["bootstrap"]["metrics"], *(m["metrics"] for m in status["members"])]
        deadline = time.monotonic() + 20
        while True:
            failed = [await anyio.to_thread.run_sync(_export_failed, url) for url in urls]
            if all(n > 0 for n in failed[1:]):  # the bootstrap may not have ended a span
                break
            assert time.monotonic() < deadline, dict(zip(urls, failed, strict=True))
            await anyio.sleep(0.5)
    finally:
        started = time.monotonic()
        await anyio.to_thread.run_sync(mesh.stop)
        assert time.monotonic() - started < 15.0


def _export_failed(url: str) -> float:
    text = httpx.get(url, timeout=10).text
    line = next(line for line in text.splitlines()
                if line.startswith("pdmesh_trace_spans_dropped_total")
                and 'cause="export_failed"' in line)
    return float(line.split()[-1])


async def test_the_trace_names_cached_computed_and_moved_tokens(traced):
    """The same prompt twice: the second request's prefill call says how much of it the
    prefill found cached, how much it computed, and how much KV moved (the decode held the
    rest); the first computed and moved it all."""
    mesh, receiver = traced
    prompt = "lighthouse keeper logs the tide " * 12
    calls = []
    for _ in range(2):
        before = len(roots_since(receiver, 0, 0))
        assert await run(mesh, prompt, 3) == 3
        root = roots_since(receiver, 0, before + 1)[-1]
        spans = settled_trace(receiver, root, {"pdmesh-router", "pdmesh-prefill",
                                               "pdmesh-decode"})
        calls.append(by_service(spans, "pdmesh-router", "prefill call")["attributes"])
        await anyio.to_thread.run_sync(wait_quiet, mesh, 5.0)  # pages sealed and cached
    first, second = calls
    n = first["pdmesh.prompt.cached_tokens"] + first["pdmesh.prompt.computed_tokens"]
    assert first["pdmesh.prompt.cached_tokens"] == 0 and first["pdmesh.kv.moved_tokens"] == n
    assert second["pdmesh.prompt.cached_tokens"] >= 16
    assert second["pdmesh.prompt.cached_tokens"] + second["pdmesh.prompt.computed_tokens"] == n
    assert second["pdmesh.kv.held_tokens"] >= 16
    assert second["pdmesh.kv.held_tokens"] + second["pdmesh.kv.moved_tokens"] == n
