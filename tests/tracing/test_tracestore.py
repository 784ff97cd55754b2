"""The embedded trace store and `pdmesh traces`, fed by a real OTLP exporter over gRPC."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from libs.tracing.spans import mark_aborted
from pdmesh import tracestore
from pdmesh.localmesh import free_port


def traces_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdmesh.cli", "traces", *args],
                          capture_output=True, text=True, timeout=60)


def test_spans_exported_over_otlp_land_in_the_store_and_the_cli_finds_them(tmp_path):
    db = tmp_path / "traces.sqlite"
    server, port = tracestore.serve(db, "127.0.0.1", free_port(), max_spans=1000)
    try:
        provider = TracerProvider(resource=Resource.create({"service.name": "pdmesh-router"}))
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True)))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("text_completion tiny", kind=SpanKind.SERVER) as ok:
            ok.set_attribute("pdmesh.request.id", "aa" * 16)
            with tracer.start_as_current_span("prefill call"):
                time.sleep(0.01)
        with tracer.start_as_current_span("chat tiny", kind=SpanKind.SERVER) as bad:
            bad.set_attribute("pdmesh.request.id", "bb" * 16)
            mark_aborted(bad, "client_disconnect", "decode")
        provider.shutdown()
    finally:
        server.stop(0)

    listed = traces_cli("--db", str(db), "--json")
    assert listed.returncode == 0, listed.stderr
    roots = json.loads(listed.stdout)
    assert [r["name"] for r in roots] == ["chat tiny", "text_completion tiny"]  # newest first
    aborted = json.loads(traces_cli("--db", str(db), "--aborted", "--json").stdout)
    assert [r["attributes"]["pdmesh.abort.reason"] for r in aborted] == ["client_disconnect"]
    assert json.loads(traces_cli("--db", str(db), "--reason", "deadline", "--json").stdout) == []
    text = traces_cli("--db", str(db), "--aborted").stdout
    assert "ABORTED client_disconnect in decode" in text and "bbbbbbbbbbbb" in text
    tree = traces_cli("--db", str(db), "aaaa")  # a request id prefix
    assert tree.returncode == 0
    lines = tree.stdout.splitlines()
    assert lines[0].startswith("pdmesh-router: text_completion tiny")
    assert lines[1].startswith("  pdmesh-router: prefill call")
    slowest = json.loads(traces_cli("--db", str(db), "--slowest", "1", "--json").stdout)
    assert [r["name"] for r in slowest] == ["text_completion tiny"]


def test_the_store_drops_the_oldest_past_its_bound(tmp_path):
    store = tracestore.TraceStore(tmp_path / "t.sqlite", max_spans=5)
    rows = [(f"{i:032x}", f"{i:016x}", "", "pdmesh-router", f"r{i}", i, i + 1, 0, "", "{}", "[]")
            for i in range(8)]
    store.add(rows[:4])
    store.add(rows[4:])
    names = [r[0] for r in store._db.execute("SELECT name FROM spans ORDER BY rowid")]
    assert names == ["r3", "r4", "r5", "r6", "r7"] and store.dropped == 3
    store.close()


def test_a_missing_or_corrupt_store_is_one_clear_line(tmp_path):
    missing = traces_cli("--db", str(tmp_path / "nope.sqlite"))
    assert missing.returncode == 1 and "no trace store at" in missing.stderr
    assert "Traceback" not in missing.stderr
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not sqlite" * 100)
    broken = traces_cli("--db", str(corrupt))
    assert broken.returncode == 1 and "not a readable pdmesh trace store" in broken.stderr
    assert "Traceback" not in broken.stderr
    bad_since = traces_cli("--db", str(corrupt), "--since", "soon")
    assert bad_since.returncode == 1 and "Traceback" not in bad_since.stderr


def _rows(first: int, n: int, pad: int = 2000) -> list[tuple]:
    return [(f"{i:032x}", f"{i:016x}", "", "pdmesh-router", f"r{i}", i, i + 1, 0, "",
             json.dumps({"pad": "x" * pad}), "[]") for i in range(first, first + n)]


def test_a_full_disk_drops_the_oldest_spans_and_pdmesh_traces_says_so(tmp_path):
    """SQLite's max_page_count stands in for the disk: it fails inserts with the same
    SQLITE_FULL a full disk gives."""
    path = tmp_path / "full.sqlite"
    store = tracestore.TraceStore(path, max_spans=100_000)
    store.add(_rows(0, 10))
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages + 40}")
    for batch in range(1, 30):  # far more than 40 pages hold
        store.add(_rows(batch * 10, 10))
    assert store.dropped_full > 0
    names = [r[0] for r in store._db.execute("SELECT name FROM spans ORDER BY rowid")]
    assert names[-10:] == [f"r{i}" for i in range(290, 300)]  # the newest all kept
    assert "r0" not in names
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.add(_rows(1000, 1, pad=2_000_000))  # bigger than the whole file may grow
    store.close()

    listed = traces_cli("--db", str(path), "--limit", "3")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert f"the {store.dropped_full} oldest spans were dropped to make room" in listed.stderr
    assert listed.stdout.splitlines()[0].split()[-2] == "r299"  # the list still answers


def test_the_receiver_refuses_an_export_it_cannot_store(tmp_path):
    class Context:
        def abort(self, code, details):
            self.code, self.details = code, details
            raise RuntimeError("aborted")

    class FullStore:
        def add(self, rows):
            raise sqlite3.OperationalError("database or disk is full")

    context = Context()
    with pytest.raises(RuntimeError):
        tracestore._Receiver(FullStore()).Export(ExportTraceServiceRequest(), context)
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in context.details


def test_a_store_damaged_past_its_first_page_is_one_clear_line(tmp_path):
    path = tmp_path / "damaged.sqlite"
    store = tracestore.TraceStore(path)
    store.add(_rows(0, 200))
    store.close()
    data = bytearray(path.read_bytes())
    data[8192:] = b"\xff" * (len(data) - 8192)
    path.write_bytes(bytes(data))
    damaged = traces_cli("--db", str(path))
    assert damaged.returncode == 1 and "Traceback" not in damaged.stderr, damaged.stderr
    assert str(path) in damaged.stderr


def test_the_receiver_does_not_share_a_port_another_process_listens_on(tmp_path):
    # gRPC sets SO_REUSEPORT by default, so two listeners that both ask for it share a port
    # and the kernel splits the connections between them. The receiver must not ask: a
    # port held by a listener that does is a bind error, not a silent half of the traffic.
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError):
            server, _ = tracestore.serve(tmp_path / "t.sqlite", "127.0.0.1", port, max_spans=10)
            server.stop(None)
