"""`python -m pdmesh.bench.transfer`, tiny: real NIXL between two processes, its JSON."""

from __future__ import annotations

import json

import pytest
import torch

from pdmesh.bench import transfer

ROW_KEYS = {"case", "pattern", "tokens", "pages", "bytes", "descriptors", "writes", "nixl_s",
            "post_s", "memcpy_s", "nixl_gbps", "memcpy_gbps", "ratio", "reference_ratio"}


def run(tmp_path, *args: str) -> dict:
    out = tmp_path / "transfer.json"
    result = transfer.main(["--tokens", "16,48", "--reference-mib", "2", "--reps", "1",
                            "--chunk-tokens", "32", "--out", str(out), *args])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    return result


def check(result: dict, device: str, page_bytes: int) -> None:
    assert result["device"] == device and result["page_bytes"] == page_bytes
    reference, rows = result["reference"], result["rows"]
    assert reference["descriptors"] == 1
    assert reference["bytes"] == -(-2 * 2**20 // page_bytes) * page_bytes
    assert result["latency"]["descriptors"] == 1 and result["latency"]["nixl_s"] > 0
    assert [(r["case"], r["pattern"], r["pages"], r["descriptors"], r["writes"])
            for r in rows] == [
        ("2 MB", "contiguous", reference["bytes"] // page_bytes, 1, 1),
        ("16-token prompt", "contiguous", 1, 1, 1),
        ("16-token prompt", "scattered", 1, 1, 1),
        ("16-token prompt", "chunks of 32", 1, 1, 1),
        ("48-token prompt", "contiguous", 3, 1, 1),
        ("48-token prompt", "scattered", 3, 3, 1),
        ("48-token prompt", "chunks of 32", 3, 2, 2),  # pages 0-1, then 2
    ]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["bytes"] == r["pages"] * page_bytes and r["nixl_gbps"] > 0
    assert rows[0]["reference_ratio"] == pytest.approx(1.0)


def test_cpu_run_writes_the_fields_pdmesh_bench_reads(tmp_path) -> None:
    check(run(tmp_path), "cpu", transfer.page_bytes(torch.float32))


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_moves_vram_to_vram_between_processes(tmp_path) -> None:
    result = run(tmp_path, "--device", "cuda")
    check(result, "cuda", transfer.page_bytes(torch.bfloat16))
    assert result["dtype"] == "bfloat16"
