"""A real OTLP/gRPC receiver for mesh tests, and helpers to read the traces it got.

The receiver is opentelemetry-proto's TraceService served by grpcio; a mesh exports to it
through the standard OTEL_* variables, as it would to Jaeger or a collector.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import anyio
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdmesh.client import GenerateClient, Piece
from pdmesh.localmesh import free_port

ERROR = 2  # STATUS_CODE_ERROR


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
              after_tokens: int | None = None, timeout: float = 60) -> int:
    tokens = 0
    async with GenerateClient(mesh.router, timeout=timeout) as client:
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


def serve_receiver() -> tuple[Receiver, grpc.Server, dict[str, str]]:
    """A started receiver, its server, and the environment that points a mesh at it."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    return receiver, server, env
