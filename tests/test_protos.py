"""The committed gRPC code must be exactly what protos/ generates."""

from __future__ import annotations

import subprocess
import sys

from pdmesh import protogen


def test_generated_code_is_fresh(tmp_path):
    # protoc runs in its own process: inside a pytest process that has already loaded
    # grpc, torch and the protobuf runtime, grpc_tools' protoc has segfaulted.
    subprocess.run(
        [sys.executable, "-m", "pdmesh.protogen", "--out", str(tmp_path)], check=True, timeout=120
    )
    fresh = sorted((tmp_path / "pdmesh" / "v1").iterdir())
    committed = protogen.ROOT / "pdmesh" / "v1"
    assert [p.name for p in fresh] == sorted(
        p.name for p in committed.iterdir() if p.is_file() and not p.name.endswith(".pyc")
    )
    stale = [p.name for p in fresh if p.read_bytes() != (committed / p.name).read_bytes()]
    assert not stale, f"run `python -m pdmesh.protogen`: stale {stale}"
