"""Decode throughput of the engine alone (no services) vs transformers' generate, on one device.

    python -m pdmesh.bench.engine [--model smollm2] [--device cpu|cuda] [--weights native|nvfp4]
                                  [--tokens 64] [--streams 16] [--json FILE]

Both sides generate exactly ``tokens`` new tokens per stream (EOS ignored) from the same chat
prompts as ``pdmesh bench``; tok/s = new tokens / wall time including prefill, so the two
numbers are comparable. Runs are alternated (ours, transformers) and the best is kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

from libs.engine.engine import DecodeSeq, Engine, PrefillSeq
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from pdmesh.bench.prompts import chat


def _prompts(tok, n: int) -> list[list[int]]:
    if tok is None:  # random weights without a tokenizer: synthetic prompts of similar lengths
        return [list(range(100 + i, 130 + 2 * i)) for i in range(n)]
    return [tok.apply_chat_template(chat(i)) for i in range(n)]


def bench_ours(m, prompts: list[list[int]], tokens: int, device: str) -> float:
    pool = KvPool(m.config, 16 + len(prompts) * ((max(map(len, prompts)) + tokens) // 16 + 1),
                  16, device=device, dtype=m.weights.dtype)
    eng = Engine(m.config, m.weights, pool)
    _sync(device)
    t0 = time.perf_counter()
    pages = [pool.alloc(pool.pages_for(len(ids) + tokens)) for ids in prompts]
    first = eng.prefill_batch([PrefillSeq(ids, pg) for ids, pg in zip(prompts, pages, strict=True)])
    seqs = [
        DecodeSeq(pg, len(ids), int(t))
        for ids, pg, t in zip(prompts, pages, first.argmax(-1), strict=True)
    ]
    for _ in range(tokens - 1):
        nxt = eng.decode_step(seqs).argmax(-1).tolist()
        for s, t in zip(seqs, nxt, strict=True):
            s.pos, s.token = s.pos + 1, t
    _sync(device)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def bench_hf(model, tok, prompts: list[list[int]], tokens: int, device: str) -> float:
    width = max(map(len, prompts))
    pad = 2
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=pad,
        )
    _sync(device)
    assert out.shape[1] - width == tokens
    return len(prompts) * tokens / (time.perf_counter() - t0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
    prompts = _prompts(m.tokenizer, args.streams)
    hf = None
    if not args.no_hf and args.model == "smollm2":
        from libs.engine.hf_reference import load_hf_reference

        hf = load_hf_reference().to(args.device, m.weights.dtype)
        bench_hf(hf, m.tokenizer, prompts[:2], 4, args.device)  # warm-up
    bench_ours(m, prompts[:2], 4, args.device)  # warm-up
    res: dict = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "weights": args.weights,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "new_tokens": args.tokens,
        "streams": args.streams, "repeats": args.repeats,
    }
    runs: dict[str, list[float]] = {}
    # Alternate ours/transformers so load from other processes hits both alike; keep the best.
    for _ in range(args.repeats):
        for n in (1, args.streams):
            runs.setdefault(f"ours_{n}_stream_tok_s", []).append(
                bench_ours(m, prompts[:n], args.tokens, args.device)
            )
            if hf is not None:
                runs.setdefault(f"hf_{n}_stream_tok_s", []).append(
                    bench_hf(hf, m.tokenizer, prompts[:n], args.tokens, args.device)
                )
    res.update({k: max(v) for k, v in runs.items()})
    res["all_runs"] = runs
    for k, v in res.items():
        print(f"{k:>24}: {v:.1f}" if isinstance(v, float) else f"{k:>24}: {v}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
