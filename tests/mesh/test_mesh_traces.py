"""Traces across the mesh, received by a real OTLP/gRPC receiver inside the test.

The receiver is opentelemetry-proto's TraceService served by grpcio; the mesh exports to
it through the standard OTEL_* variables, as it would to Jaeger or a collector.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent import futures

import anyio
import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import free_port, start_mesh, wait_quiet

PAUSE = 1.0  # the prefill waits this long between computing a chunk and writing it


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[dict] = []

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "status": s.status.code, "message": s.status.message,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events],
                        })
        return trace_service_pb2.ExportTraceServiceResponse()



def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    mesh = start_mesh(tmp_path_factory.mktemp("traced"), model="tiny", extra_env=env,
                      up_args=["--faults", f"pause_between_chunks={PAUSE}"])
    yield mesh, receiver
    mesh.stop()
    server.stop(0)


def roots_since(receiver: Receiver, started: float, count: int) -> list[dict]:
    """The router's request spans (the roots), waiting until `count` arrived."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with receiver.lock:
            roots = [s for s in receiver.spans
                     if s["service"] == "pdmesh-router" and s["parent"] == ""]
        if len(roots) >= count:
            return roots
        time.sleep(0.1)
    raise AssertionError(f"{len(roots)} root spans, wanted {count}")


def settled_trace(receiver: Receiver, root: dict, services: set[str]) -> list[dict]:
    """All spans of root's trace, once every service in `services` has exported its own."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with receiver.lock:
            spans = [s for s in receiver.spans if s["trace"] == root["trace"]]
        if services <= {s["service"] for s in spans}:
            time.sleep(0.3)  # late children of the same batch
            with receiver.lock:
                return [s for s in receiver.spans if s["trace"] == root["trace"]]
        time.sleep(0.1)
    raise AssertionError(f"services {services} not all in trace: {spans}")


async def run(mesh, prompt: str, max_tokens: int, cancel_after: float | None = None,
              after_tokens: int | None = None) -> int:
    tokens = 0
    async with GenerateClient(mesh.router, timeout=60) as client:
        with anyio.move_on_after(cancel_after if cancel_after is not None else 120):
            async for item in client.generate(prompt=prompt, max_tokens=max_tokens,
                                              ignore_eos=True):
                if isinstance(item, Piece):
                    tokens += len(item.token_ids)
                    if after_tokens is not None and tokens >= after_tokens:
                        break
    return tokens


def by_service(spans: list[dict], service: str, name: str) -> dict:
    return next(s for s in spans if s["service"] == service and s["name"] == name)


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
    assert by_service(spans, "pdmesh-decode", "generate")["parent"] == decode["id"]
    assert all(s["status"] != 2 for s in spans), [s for s in spans if s["status"] == 2]


@pytest.mark.parametrize(("stage", "prompt_words", "kwargs"), [
    ("prefill", 700, {"cancel_after": 0.3}),  # inside the pause after chunk 1
    ("decode", 20, {"after_tokens": 2}),
])
async def test_a_client_disconnect_ends_every_touched_span_as_an_abort(
        traced, stage, prompt_words, kwargs):
    mesh, receiver = traced
    before = len(roots_since(receiver, 0, 0))
    await run(mesh, "river engine " * (prompt_words // 2), 400, **kwargs)
    root = roots_since(receiver, 0, before + 1)[-1]
    involved = {"pdmesh-router", "pdmesh-decode"} | (
        {"pdmesh-prefill"} if stage == "prefill" else set())
    spans = settled_trace(receiver, root, involved)
    expected = {"pdmesh.abort.reason": "client_disconnect", "pdmesh.abort.stage": stage}
    server_spans = [root, by_service(spans, "pdmesh-decode", "decode")]
    if stage == "prefill":
        server_spans.append(by_service(spans, "pdmesh-prefill", "prefill"))
    for s in server_spans:
        assert s["status"] == 2, s  # STATUS_CODE_ERROR
        assert {k: s["attributes"].get(k) for k in expected} == expected, s
    abort = by_service(spans, "pdmesh-router", "abort")
    assert abort["events"].count("AbortAck") >= 1
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
    finally:
        started = time.monotonic()
        await anyio.to_thread.run_sync(mesh.stop)
        assert time.monotonic() - started < 15.0
