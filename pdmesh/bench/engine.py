"""The engine alone, in this process: no services, no transfer, the same device and weights.

    python -m pdmesh.bench.engine [--model smollm2] [--device cpu|cuda] [--weights native|nvfp4]
                                  [--tokens 64] [--streams 16] [--json FILE]

`EngineAlone.serve` runs a workload (pdmesh/bench/workload.py) with continuous batching,
greedy: requests are admitted as they arrive while the batch has room (the decode's
default --max-batch for the device) and the pool has their pages; each turn of the loop
runs one prefill pass (the next chunk of every admitted prompt, packed like the prefill
service's defaults) and then one decode step of every running sequence. This is what
`pdmesh bench` sets beside the mesh: the mesh's cost over it is its own overhead.

Alone, this module compares the engine with transformers' generate: ``--streams``
concurrent streams of ``--tokens`` new tokens each (EOS ignored) from the same chat prompts
as ``pdmesh bench``, tokens/s = new tokens / wall time including prefill. Runs alternate
(ours, transformers) and the best is kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from libs.engine.engine import DecodeSeq, Engine, PrefillSeq
from libs.engine.kvpool import KvPool
from libs.engine.loader import LoadedModel, load_model
from libs.member.sizing import default_max_batch, default_prefill_tokens
from pdmesh.bench.progress import Progress
from pdmesh.bench.prompts import chat
from pdmesh.bench.workload import Record, Request, Workload, summarize

PAGE_SIZE = 16


@dataclass(eq=False)
class _Stream:
    request: Request
    record: Record
    pages: list[int]
    prefilled: int = 0  # prompt tokens whose KV is in the pool
    pos: int = 0
    token: int = 0


class EngineAlone:
    """One engine and one pool, big enough for ``max_batch`` of the largest request."""

    def __init__(self, loaded: LoadedModel, workloads: list[Workload],
                 max_batch: int | None = None) -> None:
        device = str(loaded.weights.device)
        self.max_batch = max_batch or default_max_batch(device)
        # the prefill service's defaults on this device (pdmesh prefill --help)
        self.chunk_tokens, self.pack_tokens = default_prefill_tokens(device)
        need = 1
        for w in workloads:
            per_request = sorted((-(-(len(r.prompt_ids) + r.output_tokens) // PAGE_SIZE)
                                  for r in w.requests), reverse=True)
            need = max(need, sum(per_request[: self.max_batch]))
        self.pool = KvPool(loaded.config, need, PAGE_SIZE, device=loaded.weights.device,
                           dtype=loaded.weights.dtype)
        self.engine = Engine(loaded.config, loaded.weights, self.pool)  # as a member builds it
        # captured up front, as the members do: a capture inside a run would be timed
        self.engine.capture_decode_graphs(self.max_batch)
        self.engine.capture_prefill_graphs(self.pack_tokens)

    def serve(self, workload: Workload, progress: Progress) -> list[Record]:
        pool, engine = self.pool, self.engine
        start = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - start

        reqs = workload.requests
        records: list[Record | None] = [None] * len(reqs)
        if workload.rate:
            due = deque(zip(workload.arrivals(), reqs, strict=True))
            later: deque[Request] = deque()
        else:
            due = deque((0.0, r) for r in reqs[: workload.concurrency])
            later = deque(reqs[workload.concurrency:])
        queued: deque[tuple[float, Request]] = deque()
        prefilling: list[_Stream] = []
        running: list[_Stream] = []

        def emit(s: _Stream, token: int, t: float) -> bool:
            """Record one new token; True when the stream has all it asked for."""
            s.token = token
            s.record.pieces.append((t, 1))
            s.record.token_ids.append(token)
            if s.record.tokens < s.request.output_tokens:
                return False
            pool.free(s.pages)
            records[s.request.index] = s.record
            progress.add(done=1)
            if later:  # closed loop: the next request is sent now
                due.append((now(), later.popleft()))
            return True

        while due or queued or prefilling or running:
            t = now()
            while due and due[0][0] <= t:
                queued.append(due.popleft())
            if not (queued or prefilling or running):
                time.sleep(due[0][0] - t)
                continue
            while queued and len(prefilling) + len(running) < self.max_batch:
                sent, r = queued[0]
                need = pool.pages_for(len(r.prompt_ids) + r.output_tokens)
                if need > pool.free_count:
                    break
                queued.popleft()
                prefilling.append(_Stream(r, Record(sent), pool.alloc(need)))
            if prefilling:
                self._prefill_pass(prefilling, running, emit, now, progress)
            if running:
                logits = engine.decode_step([DecodeSeq(s.pages, s.pos, s.token) for s in running])
                tokens = logits.argmax(-1).tolist()  # the step's one device-to-host copy
                t = now()
                progress.add(tokens=len(running))
                for s in running:
                    s.pos += 1
                running[:] = [s for s, tok in zip(running, tokens, strict=True)
                              if not emit(s, tok, t)]
        return records

    def _prefill_pass(self, prefilling: list[_Stream], running: list[_Stream], emit, now,
                      progress: Progress) -> None:
        """The next chunk of each admitted prompt, as many as fit one pack."""
        pack: list[tuple[_Stream, int]] = []
        budget = self.pack_tokens
        for s in prefilling:
            n = min(self.chunk_tokens, len(s.request.prompt_ids) - s.prefilled)
            if pack and n > budget:
                break
            pack.append((s, n))
            budget -= n
        logits = self.engine.prefill_batch([
            PrefillSeq(s.request.prompt_ids[s.prefilled : s.prefilled + n], s.pages, s.prefilled)
            for s, n in pack
        ])
        ended = []
        for row, (s, n) in enumerate(pack):
            s.prefilled += n
            if s.prefilled == len(s.request.prompt_ids):
                ended.append((row, s))
        if not ended:
            return
        firsts = logits[[row for row, _ in ended]].argmax(-1).tolist()
        t = now()
        progress.add(tokens=len(ended))
        for (_, s), token in zip(ended, firsts, strict=True):
            prefilling.remove(s)
            s.pos = len(s.request.prompt_ids)
            if not emit(s, token, t):
                running.append(s)


# ---------------------------------------------------------------- where the time goes


def breakdown(alone: EngineAlone, long_ids: list[int], short: list[list[int]],
              tokens: int) -> dict:
    """Step times of the engine in isolation: a long prompt prefilled in chunks, one chat
    prompt, and decode steps at batch 1 and len(short) at a mid-generation context."""
    eng, pool = alone.engine, alone.pool
    device = str(eng.device)
    long_pages = pool.alloc(pool.pages_for(len(long_ids)))
    pages = [pool.alloc(pool.pages_for(len(p) + tokens)) for p in short]

    def best_ms(fn, n: int) -> float:
        times = []
        for _ in range(n + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return 1e3 * min(times[1:])

    def chunked():
        for s in range(0, len(long_ids), alone.chunk_tokens):
            eng.prefill(long_ids[s : s + alone.chunk_tokens], long_pages, s)

    pos = max(map(len, short)) + tokens // 2
    res = {
        "prefill_long_chunked_ms": best_ms(chunked, 2), "chunk_tokens": alone.chunk_tokens,
        "prefill_long_tokens": len(long_ids),
        "prefill_one_chat_ms": best_ms(lambda: eng.prefill(short[0], pages[0]), 3),
        "decode_context": pos,
    }
    for b in sorted({1, len(short)}):
        seqs = [DecodeSeq(pages[i], pos, 5) for i in range(b)]
        res[f"decode_step_b{b}_ms"] = best_ms(lambda seqs=seqs: eng.decode_step(seqs), 8)
    pool.free(long_pages)
    for p in pages:
        pool.free(p)
    return res


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- python -m pdmesh.bench.engine


def _requests(tok, n: int, tokens: int) -> list[Request]:
    if tok is None:  # random weights without a tokenizer: synthetic prompts of similar lengths
        return [Request(i, list(range(100 + i, 130 + 2 * i)), tokens) for i in range(n)]
    return [Request(i, tok.apply_chat_template(chat(i)), tokens) for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdmesh.bench.engine",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="native", choices=["native", "nvfp4"],
                    help="our engine's linear weights (transformers always runs native)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs; best is kept")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", default="bench-results/engine.json", help="JSON output path")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    m = load_model(args.model, args.device, getattr(torch, args.dtype), args.weights)
    reqs = _requests(m.tokenizer, args.streams, args.tokens)
    loads = {n: Workload(f"{n} streams", reqs[:n], concurrency=n) for n in (1, args.streams)}
    warm = Workload("warm-up", [Request(i, r.prompt_ids, 4) for i, r in enumerate(reqs[:2])], 2)
    alone = EngineAlone(m, list(loads.values()))
    hf = pad = None
    if not args.no_hf:
        from pdmesh.bench import hf as hf_side

        hf = hf_side.load_transformers(args.model, args.device, m.weights.dtype)
        pad = _pad_id(m)
        hf_side.serve(hf, pad, warm, Progress("transformers warm-up", 2))
    alone.serve(warm, Progress("engine warm-up", 2))
    res: dict = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "weights": args.weights,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "new_tokens": args.tokens,
        "streams": args.streams, "repeats": args.repeats,
    }
    runs: dict[str, list[float]] = {}
    # Alternate ours/transformers so load from other processes hits both alike; keep the best.
    for _ in range(args.repeats):
        for n, load in loads.items():
            with Progress(f"engine {n} streams", n) as progress:
                got = summarize(alone.serve(load, progress))
            runs.setdefault(f"ours_{n}_stream_tok_s", []).append(got["output_tok_s"])
            if hf is not None:
                from pdmesh.bench import hf as hf_side

                with Progress(f"transformers {n} streams", n) as progress:
                    got = summarize(hf_side.serve(hf, pad, load, progress))
                runs.setdefault(f"hf_{n}_stream_tok_s", []).append(got["output_tok_s"])
    res.update({k: max(v) for k, v in runs.items()})
    res["all_runs"] = runs
    for k, v in res.items():
        print(f"{k:>24}: {v:.1f}" if isinstance(v, float) else f"{k:>24}: {v}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


def _pad_id(m: LoadedModel) -> int:
    tok = m.tokenizer
    if tok is not None and tok.hf.pad_token_id is not None:
        return tok.hf.pad_token_id
    return m.config.eos_token_ids[0]


if __name__ == "__main__":
    main()
