"""`pdmesh bench --suite nvfp4` on the CPU at toy sizes: every phase and the report run, so
the GPU run (bench/nvfp4_gpu.sh) cannot fail on a Python error."""

from __future__ import annotations

import json
import subprocess
import sys

TOY = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--suite-tokens", "4",
       "--batches", "1,2", "--sweep", "1,2", "--sweep-context", "32", "--sweep-steps", "2",
       "--ttft-lens", "64", "--kv-prompt-tokens", "128", "--agreement-prompts", "2",
       "--agreement-tokens", "8", "--reps", "1", "--ttft-reps", "2", "--sweep-rounds", "2"]


def suite(tmp_path, *extra: str, timeout: float = 500) -> tuple[dict, str]:
    out = tmp_path / "nvfp4.json"
    run = subprocess.run([sys.executable, "-m", "pdmesh.cli", "bench", "--suite", "nvfp4",
                          *TOY, "--out", str(out), *extra],
                         capture_output=True, text=True, timeout=timeout)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert run.returncode == (1 if result["errors"] else 0), run.stderr[-2000:]
    return result, out.with_suffix(".md").read_text()


def test_every_phase_of_the_suite_runs_and_reports(tmp_path):
    r, md = suite(tmp_path, "--chunk-tokens", "128")  # the long prompts in one chunk
    assert r["errors"] == {} and r["skipped"] == [] and r["running"] is None
    assert r["read_bandwidth"]["gb_s"] > 0
    assert r["limits"]["nvfp4"]["read_bytes_per_token"] < r["limits"]["native"][
        "read_bytes_per_token"]
    for fmt in ("native", "nvfp4"):
        mesh = r["mesh"][fmt]
        for b in ("1", "2"):
            assert mesh["decode"][b]["errors"] == {} and mesh["decode"][b]["decode_tok_s"] > 0
        assert mesh["ttft_s"]["64"] > 0 and mesh["ttft_s"]["128"] > 0
        runs = mesh["ttft_runs_s"]["64"]  # --ttft-reps 2: the row is the lower
        assert len(runs) == 2 and mesh["ttft_s"]["64"] == min(runs)
        assert mesh["kv_transfer"]["rooms"] == 1
        sweep = r["engine"][fmt]["sweep"]
        assert [row["batch"] for row in sweep] == [1, 2] and all(row["tok_s"] > 0 for row in sweep)
        assert r["engine"][fmt]["graph_vs_eager"]["equal"] is True
    native, nvfp4 = r["mesh"]["native"]["kv_transfer"], r["kv"]["kv-nvfp4"]["kv_transfer"]
    # fp32 KV against 4.5 bits a value (plus the page's scales)
    assert nvfp4["bytes_per_room"] < 0.2 * native["bytes_per_room"]
    assert nvfp4["tail_ms"] > 0 and native["tail_ms"] > 0
    greedy = r["mesh"]["native"]["greedy"]
    assert len(greedy) == 2 and all(len(tokens) == 8 for tokens in greedy)
    lengths = r["kv"]["kv-nvfp4"]["agreement_lengths"]
    assert len(lengths) == 2 and all(0 <= n <= 8 for n in lengths)
    control = r["mesh"]["native"]["control_agreement_lengths"]
    assert len(control) == 2 and all(0 <= n <= 8 for n in control)
    assert "control_agreement_lengths" not in r["mesh"]["nvfp4"]  # native weights' alone
    assert "| mesh decode, batch 1 (tok/s) |" in md and "Greedy agreement" in md
    assert "Control, native KV" in md
    assert "TTFT rows: the lowest of 2 requests" in md and "fastest of 2 runs" in md
    assert r["sizes"]["chunk_tokens"] == 128 and "Prefill chunk: 128 tokens" in md
    assert "| engine decode, batch 2 (tok/s) | -" not in md


def test_a_time_budget_skips_the_phases_that_would_not_fit_and_still_reports(tmp_path):
    r, md = suite(tmp_path, "--time-budget", "5", timeout=120)
    assert r["skipped"] == ["mesh-native", "mesh-nvfp4", "engine-native", "engine-nvfp4",
                            "mesh-kv-nvfp4"]
    assert r["limits"]["native"]["limit_tok_s"] > 0
    assert "Skipped for the time budget: mesh-native" in md


def test_the_budget_estimates_a_phase_by_its_like_else_its_kind():
    from pdmesh.bench.nvfp4_suite import FIRST_ESTIMATE_S, Budget

    budget = Budget(120.0)
    budget.start -= 10  # 10 s spent
    assert budget.allows("mesh") and FIRST_ESTIMATE_S["mesh"] < 110
    assert not Budget(50.0).allows("mesh")  # the first mesh is estimated at 90 s
    budget.took("mesh", "mesh-native", 30.0)
    budget.took("mesh", "mesh-nvfp4", 115.0)
    assert not budget.allows("mesh")  # 10 s spent + the longest mesh, 115 s
    assert budget.allows("mesh", like="mesh-native")  # 10 + 30
    assert Budget(None).allows("mesh")


def test_agreement_lengths_count_the_shared_leading_tokens():
    from pdmesh.bench.nvfp4_suite import agreement_lengths

    assert agreement_lengths([[1, 2, 3], [1, 2, 3], [4]], [[1, 2, 3], [1, 9, 3], [5]]) == [
        3, 1, 0]


def test_the_sweeps_overlapped_steps_decode_what_serial_steps_do():
    """The sweep feeds each step the previous one's ids from the device: its tokens must be
    those of steps run one after the other, each fed from the host."""
    import torch

    from libs.engine.engine import DecodeSeq, Engine
    from libs.engine.host_tokens import HostTokens
    from libs.engine.kvpool import KvPool
    from libs.engine.loader import load_model
    from pdmesh.bench.nvfp4_engine import decode_overlapped

    loaded = load_model("tiny", torch.device("cpu"), torch.float32, "native")
    pool = KvPool(loaded.config, 16, 16, dtype=torch.float32)
    engine = Engine(loaded.config, loaded.weights, pool)
    prompts = [[5, 9, 11, 3], [7, 7, 2, 40], [1, 2]]
    pages = [pool.alloc(2) for _ in prompts]
    first = [int(engine.prefill(p, pg).argmax()) for p, pg in zip(prompts, pages, strict=True)]
    # every sequence at position 4 (the third's prompt leaves positions 2-3 stale: the same
    # stale KV for both runs, whose steps rewrite positions 4 on alike)
    serial, tokens = [], first
    for i in range(6):
        seqs = [DecodeSeq(pg, 4 + i, t) for pg, t in zip(pages, tokens, strict=True)]
        tokens = engine.decode_step(seqs).argmax(-1).tolist()
        serial.append(tokens)
    overlapped = decode_overlapped(engine, pages, first, 4, 6, HostTokens())
    assert overlapped == serial
    assert len({t for step in serial for t in step}) > 1  # not one token throughout
