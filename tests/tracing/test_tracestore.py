"""The embedded trace store and `pdmesh traces`, fed by a real OTLP exporter over gRPC."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
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
