"""The mesh against transformers ``generate``, side by side in one run on one machine.

    pdmesh bench [--tokens 64] [--streams 16] [--reps 2] [--out FILE.json]
    python -m pdmesh.bench.mesh ...     (the same flags; --help lists them)

Measures, for SmolLM2-135M (fp32 unless --dtype/--hf-dtype say otherwise), one side after
the other (never concurrently):

* single-stream decode tokens/s: (n - 1) / (t_last_token - t_first_token) of one greedy stream
  of ``--tokens`` new tokens (EOS ignored). transformers is timed by a streamer that stamps
  every step; the mesh by the arrival of each streamed piece at a gRPC client.
* ``--streams`` concurrent streams, aggregate tokens/s: streams x tokens / wall time from the
  first request to the last token (prefill included). transformers: one batched ``generate``
  with left padding and an attention mask; the mesh: that many concurrent gRPC requests.
* time to first token for a ~1k-token prompt: transformers ``generate(max_new_tokens=1)``
  wall time; the mesh: request sent to first piece received (router, prefill, KV transfer).
* KV transfer GB/s (NIXL WRITE between two processes) vs ``copy_`` of the same bytes, by
  running ``python -m pdmesh.bench.transfer``.

Targets: mesh >= 1.0x transformers single-stream, >= 1.5x at 16 streams; transfer >= 70% of
memcpy. The best of ``--reps`` repetitions is reported (rates: max, latencies: min); every raw
figure is in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import torch

from pdmesh.bench import add_arguments
from pdmesh.bench.prompts import chat, long_prompt


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------- transformers


def _stamps_streamer():
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """Records when each generated step reaches the host (the first put is the prompt)."""

        def __init__(self) -> None:
            self.calls = 0
            self.times: list[float] = []

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return Stamps()


def hf_generate(model, prompts: list[list[int]], n: int, pad: int) -> dict:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stamps = _stamps_streamer()
    c0 = time.process_time()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad, streamer=stamps,
        )
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    assert out.shape[1] - width == n, f"transformers generated {out.shape[1] - width}, not {n}"
    assert len(stamps.times) == n, f"streamer saw {len(stamps.times)} steps, not {n}"
    decode = stamps.times[-1] - stamps.times[0]
    return {
        "streams": len(prompts), "tokens": n * len(prompts), "prompt_tokens": width,
        "wall_s": wall, "cpu_s": cpu, "ttft_s": stamps.times[0] - t0, "decode_s": decode,
        "step_ms": 1e3 * decode / max(1, n - 1),
        "decode_tok_s": len(prompts) * (n - 1) / decode if n > 1 else None,
        "e2e_tok_s": n * len(prompts) / wall,
    }


def run_hf(args, tok) -> dict:
    from libs.engine.hf_reference import load_hf_reference

    t0 = time.perf_counter()
    model = load_hf_reference().to(getattr(torch, args.hf_dtype))
    log(f"transformers model loaded in {time.perf_counter() - t0:.1f}s")
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else tok.eos_token_ids[0]
    single = [tok.apply_chat_template(chat(0))]
    many = [tok.apply_chat_template(chat(i)) for i in range(args.streams)]
    res: dict = {"single": [], "multi": [], "ttft": []}
    # warm-up: small batch, full batch, long prompt (allocations, first-call paths)
    hf_generate(model, many[:2], 4, pad)
    hf_generate(model, many, 4, pad)
    hf_generate(model, [tok.encode(long_prompt(tok, args.prompt_tokens, 999)[0])], 1, pad)
    for rep in range(args.reps):
        r = hf_generate(model, single, args.tokens, pad)
        res["single"].append(r)
        log(f"transformers single rep {rep}: {r['decode_tok_s']:.1f} tok/s decode, "
            f"{r['e2e_tok_s']:.1f} end-to-end")
        r = hf_generate(model, many, args.tokens, pad)
        res["multi"].append(r)
        log(f"transformers {args.streams} streams rep {rep}: {r['e2e_tok_s']:.1f} tok/s, "
            f"step {r['step_ms']:.1f} ms, prefill {1e3 * r['ttft_s']:.0f} ms")
        text, _ = long_prompt(tok, args.prompt_tokens, rep)
        r = hf_generate(model, [tok.encode(text)], 1, pad)
        res["ttft"].append(r)
        log(f"transformers TTFT rep {rep}: {1e3 * r['wall_s']:.0f} ms "
            f"({r['prompt_tokens']} prompt tokens)")
    del model
    gc.collect()
    return res


# ---------------------------------------------------------------- mesh


async def _stream(client, model: str, n: int, t0: float | None = None, **kw) -> dict:
    from pdmesh.client import Piece

    t0 = time.perf_counter() if t0 is None else t0
    times: list[float] = []
    counts: list[int] = []
    done = None
    async for ev in client.generate(model=model, max_tokens=n, temperature=0.0,
                                    ignore_eos=True, **kw):
        if isinstance(ev, Piece):
            if ev.token_ids:
                times.append(time.perf_counter())
                counts.append(len(ev.token_ids))
        else:
            done = ev
    end = time.perf_counter()
    tokens = sum(counts)
    assert tokens == n, f"mesh streamed {tokens} tokens, not {n} ({done})"
    after_first = tokens - counts[0]
    decode = times[-1] - times[0]
    return {
        "t0": t0, "first": times[0], "last": times[-1], "end": end, "tokens": tokens,
        "pieces": len(times), "first_piece_tokens": counts[0],
        "prompt_tokens": done.prompt_tokens if done else None,
        "finish_reason": done.finish_reason if done else None,
        "ttft_s": times[0] - t0, "decode_s": decode, "wall_s": end - t0,
        "step_ms": 1e3 * decode / after_first if after_first else None,
        "decode_tok_s": after_first / decode if after_first and decode > 0 else None,
        "e2e_tok_s": tokens / (times[-1] - t0),
    }


def _proc_cpu(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _service_pids(mesh) -> dict[str, int]:
    """The mesh's processes by service name, plus this benchmark's client process."""
    pids = {"supervisor": mesh.process.pid, "bench-client": os.getpid()}
    for pid in mesh.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        name = argv[argv.index("--name") + 1] if "--name" in argv else None
        role = argv[argv.index("pdmesh.cli") + 1] if "pdmesh.cli" in argv else str(pid)
        pids[name or role] = pid
    return pids


def _metered(pids: dict[str, int], address: str, fn, *a) -> dict:
    """Run one measured mesh call; add CPU seconds each process used during it."""
    before = {k: _proc_cpu(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    r = _mesh_call(address, fn, *a)
    wall = time.perf_counter() - t0
    after = {k: _proc_cpu(p) for k, p in pids.items()}
    r["cpu_s"] = {k: round(after[k] - before[k], 3) for k in pids
                  if after[k] is not None and before[k] is not None}
    r["cpu_wall_s"] = wall
    return r


def _mesh_call(address: str, fn, *a):
    from pdmesh.client import GenerateClient

    async def go():
        async with GenerateClient(address) as client:
            model = (await client.models())[0]
            return await fn(client, model, *a)

    return anyio.run(go)


async def _single(client, model: str, n: int) -> dict:
    return await _stream(client, model, n, messages=chat(0))


async def _multi(client, model: str, n: int, streams: int) -> dict:
    results: list[dict | None] = [None] * streams

    async def one(i: int, t0: float) -> None:
        results[i] = await _stream(client, model, n, t0=t0, messages=chat(i))

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(streams):
            tg.start_soon(one, i, t0)
    rs = [r for r in results if r is not None]
    last = max(r["last"] for r in rs)
    firsts = [r["first"] for r in rs]
    after_first = sum(r["tokens"] - r["first_piece_tokens"] for r in rs)
    steps = [r["step_ms"] for r in rs if r["step_ms"]]
    ttfts = sorted(r["ttft_s"] for r in rs)
    return {
        "streams": streams, "tokens": sum(r["tokens"] for r in rs), "wall_s": last - t0,
        "e2e_tok_s": sum(r["tokens"] for r in rs) / (last - t0),
        # decode phase: from the first stream's first token to the last stream's last token
        "decode_s": last - min(firsts),
        "decode_tok_s": after_first / (last - min(firsts)),
        "step_ms": statistics.median(steps) if steps else None,
        "ttft_median_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
        "first_token_spread_s": max(firsts) - min(firsts),
        "per_stream": [{k: v for k, v in r.items() if k not in ("t0",)} for r in rs],
    }


async def _ttft(client, model: str, text: str) -> dict:
    return await _stream(client, model, 1, prompt=text)


def run_mesh(args, tok, out_dir: Path) -> dict:
    from pdmesh.localmesh import start_mesh, wait_quiet

    env = dict(kv.split("=", 1) for kv in args.mesh_env)
    t0 = time.perf_counter()
    mesh = start_mesh(out_dir, model=args.model, prefill=args.prefill, decode=args.decode,
                      extra_env=env, timeout=300.0, dtype=args.dtype)
    res: dict = {"single": [], "multi": [], "ttft": [], "startup_s": time.perf_counter() - t0,
                 "log": str(mesh.log_path)}
    log(f"mesh up in {res['startup_s']:.1f}s (router {mesh.router}, log {mesh.log_path})")
    try:
        addr = mesh.router
        _mesh_call(addr, _single, 8)
        _mesh_call(addr, _multi, 4, args.streams)
        _mesh_call(addr, _ttft, long_prompt(tok, args.prompt_tokens, 999)[0])
        wait_quiet(mesh, 30)
        pids = _service_pids(mesh)
        res["pids"] = pids
        for rep in range(args.reps):
            r = _metered(pids, addr, _single, args.tokens)
            res["single"].append(r)
            log(f"mesh single rep {rep}: {r['decode_tok_s']:.1f} tok/s decode, "
                f"{r['e2e_tok_s']:.1f} end-to-end, TTFT {1e3 * r['ttft_s']:.0f} ms")
            wait_quiet(mesh, 30)
            r = _metered(pids, addr, _multi, args.tokens, args.streams)
            res["multi"].append(r)
            log(f"mesh {args.streams} streams rep {rep}: {r['e2e_tok_s']:.1f} tok/s, "
                f"step {r['step_ms']:.1f} ms, TTFT median {1e3 * r['ttft_median_s']:.0f} ms "
                f"max {1e3 * r['ttft_max_s']:.0f} ms")
            wait_quiet(mesh, 30)
            text, _ = long_prompt(tok, args.prompt_tokens, rep)
            r = _metered(pids, addr, _ttft, text)
            res["ttft"].append(r)
            log(f"mesh TTFT rep {rep}: {1e3 * r['ttft_s']:.0f} ms "
                f"({r['prompt_tokens']} prompt tokens)")
            wait_quiet(mesh, 30)
        try:
            res["status"] = mesh.status()
        except Exception as e:  # informative only
            res["status"] = repr(e)
    finally:
        mesh.stop()
    return res


# ---------------------------------------------------------------- transfer


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


# ---------------------------------------------------------------- engine only


def run_engine(args, tok) -> dict:
    """The mesh's engine in this process, no services: where the mesh's time goes."""
    from libs.engine.engine import DecodeSeq, Engine
    from libs.engine.kvpool import KvPool
    from libs.engine.loader import load_model

    m = load_model(args.model)
    chunk = 256  # the prefill service's default --chunk-tokens
    long_ids = tok.encode(long_prompt(tok, args.prompt_tokens, 0)[0])
    short = [tok.apply_chat_template(chat(i)) for i in range(args.streams)]
    ctx = max(len(long_ids), max(map(len, short)) + args.tokens) + 16
    pool = KvPool(m.config, (args.streams + 1) * (ctx // 16 + 1) + 16, 16,
                  device="cpu", dtype=m.weights.dtype)
    eng = Engine(m.config, m.weights, pool)
    long_pages = pool.alloc(pool.pages_for(len(long_ids)))
    pages = [pool.alloc(pool.pages_for(len(p) + args.tokens)) for p in short]

    def best_ms(fn, n: int) -> float:
        times = []
        for _ in range(n + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times[1:])

    def chunked():
        for s in range(0, len(long_ids), chunk):
            eng.prefill(long_ids[s : s + chunk], long_pages, s)

    pos = max(map(len, short)) + args.tokens // 2  # a mid-generation context length
    res = {
        "prefill_long_chunked_ms": best_ms(chunked, 2), "chunk_tokens": chunk,
        "prefill_long_tokens": len(long_ids),
        "prefill_one_chat_ms": best_ms(lambda: eng.prefill(short[0], pages[0]), 3),
        "decode_context": pos,
    }
    for b in sorted({1, args.streams}):
        seqs = [DecodeSeq(pages[i], pos, 5) for i in range(b)]
        res[f"decode_step_b{b}_ms"] = best_ms(lambda seqs=seqs: eng.decode_step(seqs), 8)
    log("engine only: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    return res  # the model and pool are freed with this frame


# ---------------------------------------------------------------- report


def _best(runs: list[dict], key: str, lower: bool = False) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    if not vals:
        return None
    return min(vals) if lower else max(vals)


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(args, hf: dict | None, mesh: dict | None) -> list[dict]:
    def pick(side, part, key, lower=False):
        return None if side is None else _best(side[part], key, lower)

    rows = []
    specs = [
        # metric, part, key, unit scale, lower is better, target ratio
        ("single-stream decode tok/s", "single", "decode_tok_s", 1.0, False, 1.0),
        (f"{args.streams}-stream aggregate tok/s", "multi", "e2e_tok_s", 1.0, False, 1.5),
        (f"TTFT {args.prompt_tokens}-token prompt ms", "ttft", "ttft_s", 1e3, True, None),
        ("single-stream end-to-end tok/s", "single", "e2e_tok_s", 1.0, False, None),
        (f"{args.streams}-stream decode-phase tok/s", "multi", "decode_tok_s", 1.0, False, None),
        (f"{args.streams}-stream decode step ms", "multi", "step_ms", 1.0, True, None),
    ]
    for metric, part, key, scale, lower, target in specs:
        h, m = pick(hf, part, key, lower), pick(mesh, part, key, lower)
        h = None if h is None else h * scale
        m = None if m is None else m * scale
        ratio = None
        if h and m:
            ratio = h / m if lower else m / h
        rows.append({
            "metric": metric, "transformers": h, "mesh": m, "ratio": ratio, "target": target,
            "met": None if target is None or ratio is None else ratio >= target,
        })
    return rows


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict], transfer: dict | None) -> None:
    print()
    print(f"{'metric':<34} {'transformers':>12} {'mesh':>9} {'ratio':>7} {'target':>7} met?")
    for r in rows:
        target = "-" if r["target"] is None else f">={r['target']:.2f}x"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['metric']:<34} {_fmt(r['transformers']):>12} {_fmt(r['mesh']):>9} "
              f"{_fmt(r['ratio'], '.2f'):>7} {target:>7} {met}")
    print("(ratio = mesh/transformers; for ms rows transformers/mesh: > 1 means the mesh wins)")
    if transfer:
        print()
        print(f"{'KV transfer':<16} {'pattern':<11} {'bytes':>11} {'NIXL GB/s':>9} "
              f"{'memcpy GB/s':>11} {'ratio':>6} {'target':>6} met?  "
              f"{'copy_ 2thr GB/s':>15} {'ratio':>6}")
        for r in transfer["rows"]:
            print(f"{r['case']:<16} {r['pattern']:<11} {r['bytes']:>11} {r['nixl_gbps']:>9.2f} "
                  f"{r['memcpy_1thread_gbps']:>11.2f} {r['ratio']:>6.2f} {'0.70':>6} "
                  f"{'yes' if r['met'] else 'NO ':<4} "
                  f"{r['copy_all_threads_gbps']:>15.2f} {r['ratio_all_threads']:>6.2f}")
        print("(memcpy: torch copy_ on one thread, a plain memcpy; copy_ 2thr: on all of torch's "
              "threads; best of runs)")
    print()


def print_breakdown(args, hf: dict | None, mesh: dict | None, engine: dict | None) -> None:
    """Where the time goes: engine-only step times and each mesh process's CPU seconds."""
    print("time breakdown")
    if engine:
        b = args.streams
        print(f"  engine in-process: decode step b=1 {engine['decode_step_b1_ms']:.1f} ms, "
              f"b={b} {engine[f'decode_step_b{b}_ms']:.1f} ms; prefill "
              f"{engine['prefill_long_tokens']} tokens in {engine['chunk_tokens']}-token chunks "
              f"{engine['prefill_long_chunked_ms']:.0f} ms, one chat prompt "
              f"{engine['prefill_one_chat_ms']:.0f} ms")
    if hf:
        s1 = min(r["step_ms"] for r in hf["single"])
        sm = min(r["step_ms"] for r in hf["multi"])
        pm = min(r["ttft_s"] for r in hf["multi"])
        print(f"  transformers: decode step b=1 {s1:.1f} ms, b={args.streams} {sm:.1f} ms; "
              f"batched prefill of the {args.streams} prompts {1e3 * pm:.0f} ms")
    if mesh:
        s1 = min(r["step_ms"] for r in mesh["single"])
        best = max(mesh["multi"], key=lambda r: r["e2e_tok_s"])
        tail = min(r["step_ms"] for r in best["per_stream"])
        print(f"  mesh: decode step b=1 {s1:.1f} ms, b={args.streams} median {best['step_ms']:.1f}"
              f" ms (last-admitted stream {tail:.1f} ms); first tokens of the {args.streams} "
              f"streams spread over {1e3 * best['first_token_spread_s']:.0f} ms "
              f"(TTFT median {1e3 * best['ttft_median_s']:.0f}, max "
              f"{1e3 * best['ttft_max_s']:.0f} ms)")
        for part in ("single", "multi", "ttft"):
            r = mesh[part][-1]
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in r.get("cpu_s", {}).items() if v >= 0.05)
            print(f"  mesh CPU s during {part} (wall {r.get('cpu_wall_s', 0):.1f} s, "
                  f"{os.cpu_count()} cores): {cpu}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.bench.mesh")
    add_arguments(parser)
    return bench(parser.parse_args(argv))


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` (the flags of ``add_arguments``) ask for."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    from libs.engine.loader import smollm2_gguf_path
    from libs.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_gguf_path(), (2,))
    if args.model == "tiny":  # tiny's context is 2048 and its weights random: no baseline
        args.skip_hf = True
    text, n_long = long_prompt(tok, args.prompt_tokens, 0)
    result: dict = {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv], "argv": sys.argv[1:],
        "settings": {
            "model": args.model, "dtype": args.dtype, "hf_dtype": args.hf_dtype,
            "tokens_per_stream": args.tokens,
            "streams": args.streams, "reps": args.reps, "long_prompt_tokens": n_long,
            "chat_prompts": [chat(i)[0]["content"] for i in range(args.streams)],
            "chat_prompt_tokens": [len(tok.apply_chat_template(chat(i)))
                                   for i in range(args.streams)],
            "long_prompt_head": text[:200], "prefill": args.prefill, "decode": args.decode,
            "mesh_env": args.mesh_env, "transfer_reps": args.transfer_reps,
            "transfer_runs": args.transfer_runs,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": cpu_model(), "cpus": os.cpu_count(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "python": platform.python_version(), "reported": "best of reps (rates max, ms min)",
        },
    }
    try:
        import transformers

        result["settings"]["transformers"] = transformers.__version__
    except ImportError:
        pass

    hf = mesh = transfer = engine = None
    if not args.skip_hf:
        log("transformers baseline ...")
        hf = run_hf(args, tok)
    if not args.skip_engine:
        log("engine only (in-process diagnostics) ...")
        engine = run_engine(args, tok)
    if not args.skip_mesh:
        log("mesh ...")
        mesh = run_mesh(args, tok, out.parent)
    if not args.skip_transfer:
        log("KV transfer ...")
        transfer = run_transfer(args.transfer_reps, args.transfer_runs)
    rows = summarise(args, hf, mesh)
    result.update({
        "summary": rows, "transformers": hf, "mesh": mesh, "engine_only": engine,
        "transfer": transfer,
        "medians": {
            side: {part: {k: _median(runs[part], k)
                          for k in ("decode_tok_s", "e2e_tok_s", "step_ms", "ttft_s",
                                    "ttft_median_s")}
                   for part in ("single", "multi", "ttft")}
            for side, runs in (("transformers", hf), ("mesh", mesh)) if runs
        },
        "elapsed_s": time.perf_counter() - started,
    })
    print_table(rows, transfer)
    print_breakdown(args, hf, mesh, engine)
    out.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {out} in {result['elapsed_s']:.0f}s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
