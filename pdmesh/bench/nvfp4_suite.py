"""`pdmesh bench --suite nvfp4`: bf16 and NVFP4 weights side by side, and NVFP4 KV on the
wire, every figure from this one run.

    pdmesh bench --suite nvfp4 --device cuda --model random:llama3-8b --dtype bfloat16 \\
        [--time-budget 330] [--out bench-results/nvfp4-8b.json]

Phases, most valuable first; each writes the JSON and the markdown table (--out, and .md
beside it) when it ends, so a run cut short keeps what it measured:

1. read bandwidth (in this process): one large bf16 matrix-vector product through torch;
   with each format's bytes read per decode step, the weight-read limit in tokens/s.
2. a mesh per weight format (`pdmesh up --weights native|nvfp4`, --kv-transfer native):
   decode tokens/s at each of --batches (streams of --suite-tokens new tokens after a
   short prompt, the best of --reps runs; batch 1 against the limit), TTFT of each of
   --ttft-lens (the lowest of --ttft-reps requests, one at a time: a request is tens of
   ms, and a host stall costs as much), the KV moved by the --kv-prompt-tokens prompt,
   and (native only) the greedy tokens of --agreement-prompts prompts of that length.
3. the engine in this process, per format: decode tokens/s at each of --sweep batch
   sizes (engine level: a mesh per batch size would not fit the run's time; the fastest
   of --sweep-rounds runs of steps overlapped as the decode service's are), and greedy
   tokens through the CUDA graphs against the eager path.
4. unless --skip-kv, a mesh with native weights and --kv-transfer nvfp4: the same long
   prompt's KV moved, and the same greedy prompts, compared token by token with the
   native KV's.

The greedy comparison has a control, measured on the native mesh: the same prompts,
each served beside a second request, so that only the batches' rounding differs (native
weights, native KV). How long greedy text survives that is the floor of what any lossy
change can be held to on these weights: random weights give nearly flat logits, where
the argmax flips under a rounding difference.

The meshes prefill as the service does by default (the device's default chunks, each
chunk's KV written while the next one computes), so a room's KV transfer is reported as
what it costs a request: its bytes, and its tail (pdmesh_kv_transfer_tail_seconds: after the
last chunk was computed, the staging, the writes still in flight and the notifying
write), beside the TTFT of the same prompt. --chunk-tokens N prefills in chunks of N
instead (N at least the prompt: one chunk, one write, so the tail is the whole transfer;
prefill attention over one long chunk needs memory quadratic in its length).
--time-budget skips a phase that would not end in time (a phase is estimated at the
longest one of its kind so far) and says so in the JSON.
"""

from __future__ import annotations

import json
import platform
import shlex
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from pdmesh.bench import nvfp4_engine
from pdmesh.bench.progress import Progress
from pdmesh.bench.prompts import prompt_text
from pdmesh.bench.workload import Request, Workload, summarize

FORMATS = ("native", "nvfp4")
FIRST_ESTIMATE_S = {"bandwidth": 5.0, "mesh": 90.0, "engine": 45.0}  # before one of the kind ran


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] nvfp4 suite: {msg}", flush=True)


def ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",") if v.strip()]


class Budget:
    """Seconds left of --time-budget; a phase runs only if its estimate fits."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.start = seconds, time.perf_counter()
        self.taken: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, kind: str, like: str | None = None) -> bool:
        """Whether a phase of `kind` ends in time: estimated as the phase named `like`
        took, else the longest of its kind so far, else FIRST_ESTIMATE_S."""
        if self.seconds is None:
            return True
        estimate = self.taken.get(like or kind, self.taken.get(kind, FIRST_ESTIMATE_S[kind]))
        return self.elapsed() + estimate <= self.seconds

    def took(self, kind: str, name: str, seconds: float) -> None:
        self.taken[kind] = max(self.taken.get(kind, 0.0), seconds)
        self.taken[name] = seconds


class Suite:
    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.out = Path(args.out)
        self.budget = Budget(args.time_budget)
        from libs.engine.specs import load_tokenizer

        self.config, self.tok = load_tokenizer(args.model)
        self.result: dict = {
            "suite": "nvfp4", "model": args.model, "device": args.device,
            "card": (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                     else platform.processor() or platform.machine()),
            "dtype": args.dtype, "torch": torch.__version__,
            "sizes": {"suite_tokens": args.suite_tokens, "batches": ints(args.batches),
                      "sweep": ints(args.sweep), "ttft_lens": ints(args.ttft_lens),
                      "kv_prompt_tokens": args.kv_prompt_tokens,
                      "agreement_prompts": args.agreement_prompts,
                      "agreement_tokens": args.agreement_tokens,
                      "chunk_tokens": self.chunk_tokens(), "reps": args.reps,
                      "ttft_reps": self.ttft_reps(), "sweep_context": args.sweep_context,
                      "sweep_steps": args.sweep_steps, "sweep_rounds": args.sweep_rounds},
            "time_budget_s": args.time_budget, "skipped": [], "errors": {},
            "limits": {}, "mesh": {}, "kv": {}, "engine": {},
        }

    def chunk_tokens(self) -> int | None:
        """--chunk-tokens, or None: the prefill service's default."""
        return self.args.chunk_tokens

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        self.phase("bandwidth", "bandwidth", self.bandwidth, always=True)
        for fmt in FORMATS:
            self.phase("mesh", f"mesh-{fmt}", lambda fmt=fmt: self.mesh_phase(fmt, "native"))
        for fmt in FORMATS:
            self.phase("engine", f"engine-{fmt}", lambda fmt=fmt: self.engine_phase(fmt))
        if not self.args.skip_kv:
            # like the native mesh: the same weights, whose kernels are compiled by now
            self.phase("mesh", "mesh-kv-nvfp4", lambda: self.mesh_phase("native", "nvfp4"),
                       like="mesh-native")
        self.result["elapsed_s"] = self.budget.elapsed()
        self.write()
        log(f"done in {self.budget.elapsed():.0f}s: {self.out} and {self.out.with_suffix('.md')}")
        return self.result

    def phase(self, kind: str, name: str, fn, always: bool = False,
              like: str | None = None) -> None:
        if not always and not self.budget.allows(kind, like):
            log(f"{name}: skipped, the time budget would run out "
                f"({self.budget.elapsed():.0f}s of {self.budget.seconds:.0f}s spent)")
            self.result["skipped"].append(name)
            return
        log(f"{name}: start ({self.budget.elapsed():.0f}s in)")
        self.result["running"] = name  # what a run killed from outside was doing
        self.write()
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # a failed phase is reported; the next ones still run
            log(f"{name}: FAILED {e!r}")
            self.result["errors"][name] = traceback.format_exc(limit=8)
        took = time.perf_counter() - t0
        self.budget.took(kind, name, took)
        self.result.setdefault("phase_s", {})[name] = round(took, 2)
        self.result["running"] = None
        log(f"{name}: {took:.1f}s")
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=2, default=str))
        from pdmesh.bench.nvfp4_report import markdown

        self.out.with_suffix(".md").write_text(markdown(self.result))

    # ------------------------------------------------------------------ phases

    def bandwidth(self) -> None:
        bw = nvfp4_engine.read_bandwidth(self.device)
        self.result["read_bandwidth"] = bw
        for fmt in FORMATS:
            nbytes = nvfp4_engine.read_bytes_per_token(self.config, fmt, self.dtype.itemsize)
            self.result["limits"][fmt] = {"read_bytes_per_token": nbytes,
                                          "limit_tok_s": bw["gb_s"] * 1e9 / nbytes}
        log(f"read bandwidth {bw['gb_s']:.0f} GB/s; limits " + ", ".join(
            f"{f} {v['limit_tok_s']:.0f} tok/s" for f, v in self.result["limits"].items()))

    def mesh_phase(self, weights: str, kv: str) -> None:
        from pdmesh.bench.mesh import MeshSide

        a = self.args
        key = weights if kv == "native" else f"kv-{kv}"
        # the decode captures graphs up to the sweep's largest batch too: that they fit
        # beside the prefill on one card is part of what the run shows
        max_batch = max(ints(a.batches) + ints(a.sweep))
        # no prefix cache: each repetition must compute and move the whole prompt again,
        # or the best of two would report a cache hit as prefill and transfer speed
        up = (f"--kv-transfer {kv} --prefix-cache off "
              f"--decode-args {shlex.quote(f'--max-batch {max_batch}')}")
        if self.chunk_tokens():
            chunk = self.chunk_tokens()
            up += f" --prefill-args '--chunk-tokens {chunk} --max-batch-tokens {chunk}'"
        up += f" {a.mesh_args}"
        side_args = SimpleNamespace(mesh_env=a.mesh_env, model=a.model, prefill=1, decode=1,
                                    device=a.device, dtype=a.dtype, weights=weights,
                                    mesh_args=up)
        tmp = Path(tempfile.mkdtemp(prefix=f"pdmesh-nvfp4-{key}-"))
        t0 = time.perf_counter()
        side = MeshSide(side_args, tmp)
        figures: dict = {"startup_s": time.perf_counter() - t0}
        self.result["mesh" if kv == "native" else "kv"][key] = figures
        try:
            self.serve_mesh(side, figures, weights, kv)
        except Exception:
            log(f"mesh log tail ({side.log_path}):\n" + tail(side.log_path))
            raise
        finally:
            side.stop()

    def serve_mesh(self, side, figures: dict, weights: str, kv: str) -> None:
        a = self.args
        long = self.long_requests()
        short = [Request(i, [], 4, text=prompt_text(self.tok, 32, 900 + i)) for i in range(2)]
        self.serve(side, Workload("warm-up", [*short, *long.values()], 1))
        if kv == "native":
            figures["decode"] = {}
            for b in ints(a.batches):
                reqs = [Request(i, [], a.suite_tokens, text=prompt_text(self.tok, 64, i))
                        for i in range(b)]
                got, _ = self.best(side, Workload(f"batch {b}", reqs, b))
                figures["decode"][str(b)] = {k: got[k] for k in (
                    "decode_tok_s", "output_tok_s", "errors")} | {
                    "stream_decode_tok_s_p50": got["stream_decode_tok_s"].get("p50")}
                log(f"{weights} weights, batch {b}: {got['decode_tok_s'] or 0:,.1f} tok/s")
            figures["ttft_s"] = {}
            figures["ttft_runs_s"] = {}
            for n, req in long.items():
                got, spent = self.best(side, Workload(f"ttft {n}", [req], 1), self.ttft_reps())
                figures["ttft_s"][str(n)] = got["ttft_s"].get("p50")
                figures["ttft_runs_s"][str(n)] = got["runs"]
                if n == a.kv_prompt_tokens:
                    figures["kv_transfer"] = spent["kv_transfer"]
        else:
            req = long[a.kv_prompt_tokens]
            got, spent = self.best(side, Workload("kv prompt", [req], 1), self.ttft_reps())
            figures["ttft_s"] = {str(a.kv_prompt_tokens): got["ttft_s"].get("p50")}
            figures["kv_transfer"] = spent["kv_transfer"]
        if weights == "native" and not a.skip_kv:  # the reference the NVFP4 KV meets
            figures["greedy"] = self.greedy(side)
            if kv == "native":  # the control: only the batch's rounding differs
                beside = self.greedy(side, companion=True)
                figures["control_agreement_lengths"] = agreement_lengths(
                    beside, figures["greedy"])
        if kv != "native":
            reference = self.result["mesh"].get("native", {}).get("greedy")
            if reference is not None:
                figures["agreement_lengths"] = agreement_lengths(figures["greedy"], reference)

    def long_requests(self) -> dict[int, Request]:
        lens = sorted({*ints(self.args.ttft_lens), self.args.kv_prompt_tokens})
        return {n: Request(0, [], 1, text=prompt_text(self.tok, n, 500 + n)) for n in lens}

    def greedy(self, side, companion: bool = False) -> list[list[int]]:
        """--agreement-prompts prompts of --kv-prompt-tokens, one at a time (a batch of
        another composition would change bf16 bits on its own), greedy. ``companion``:
        each beside a second request of the same length (the control), its tokens."""
        a = self.args
        out = []
        for i in range(a.agreement_prompts):
            text = prompt_text(self.tok, a.kv_prompt_tokens, 700 + i)
            requests = [Request(0, [], a.agreement_tokens, text=text)]
            if companion:
                other = prompt_text(self.tok, a.kv_prompt_tokens, 800 + i)
                requests.append(Request(1, [], a.agreement_tokens, text=other))
            name = f"greedy {i}" + (" beside another" if companion else "")
            records = self.serve(side, Workload(name, requests, len(requests)))[0]
            out.append(records[0].token_ids)  # records come in request order
        return out

    def serve(self, side, workload: Workload):
        with Progress(f"mesh {workload.name}", len(workload.requests)) as progress:
            return side.serve(workload, progress)

    def ttft_reps(self) -> int:
        return max(self.args.reps, self.args.ttft_reps)

    def best(self, side, workload: Workload, reps: int | None = None) -> tuple[dict, dict]:
        """The best of --reps (or `reps`) runs (rates highest, TTFT lowest) and that run's
        spend; a TTFT's summary also lists every run's TTFT ("runs")."""
        runs = []
        for _ in range(reps or self.args.reps):
            records, spent = self.serve(side, workload)
            runs.append((summarize(records, [r.output_tokens for r in workload.requests]),
                         spent))
        if workload.requests[0].output_tokens == 1:
            got, spent = min(runs, key=lambda r: r[0]["ttft_s"].get("p50") or float("inf"))
            return got | {"runs": [r[0]["ttft_s"].get("p50") for r in runs]}, spent
        return max(runs, key=lambda r: r[0]["decode_tok_s"] or 0.0)

    def engine_phase(self, fmt: str) -> None:
        a = self.args
        with torch.inference_mode():
            self.result["engine"][fmt] = nvfp4_engine.engine_phase(
                a.model, self.device, self.dtype, fmt, ints(a.sweep), context=a.sweep_context,
                steps=a.sweep_steps, graph_check_tokens=a.agreement_tokens,
                rounds=a.sweep_rounds)


def agreement_lengths(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per prompt, how many leading greedy tokens two runs share."""
    out = []
    for a, b in zip(ours, theirs, strict=False):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        out.append(n)
    return out


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return repr(e)


def run(args) -> int:
    if args.out == "bench-results/mesh.json":
        args.out = "bench-results/nvfp4.json"
    result = Suite(args).run()
    return 1 if result["errors"] else 0
