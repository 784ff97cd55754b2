"""NVFP4 quality on the real SmolLM2: teacher-forced greedy agreement and KL vs the native engine.

    python -m bench.nvfp4_quality [--dtype bfloat16] [--tokens 64] [--variants weights-nvfp4]
                                  [--out bench-results/nvfp4_quality_bfloat16.json]

Baseline: the native engine (`--weights native`: SmolLM2's GGUF, Q4_1, dequantized to fp32
and cast to --dtype; on CPU the default bf16 runs every matmul in bf16) generates up to
--tokens greedy tokens for each of the chat-templated PROMPTS (SmolLM2's own chat template,
as the router applies it), stopping at EOS, and records its logits at every generated
position. Each variant then scores the same token sequences teacher-forced: it prefills the
prompt and decode-steps the baseline's tokens, so every position sees the same context. Per
position we compare the variant's argmax with the baseline's token (greedy-token agreement)
and compute KL(baseline || variant) over the full vocabulary, in fp64 from the fp32 logits.

Variants are callables `(prompt_ids, tokens) -> logits [len(tokens), vocab]` built by the
functions in VARIANTS; `teacher_forced` does the scoring for an engine and takes an
`after_prefill(engine, pages, n_prompt)` hook, which is where an NVFP4 KV mode plugs in
(round-trip the prompt's KV pages, as a transfer would, before the decode steps):

Built in: `kv-nvfp4` (`--kv-transfer nvfp4`: the prompt's KV pages through the NVFP4 page
round trip after the prefill), `weights-nvfp4` (`--weights nvfp4`: the same fp32 weights,
layer linears quantized to NVFP4, dense copies in --dtype), and two for context: `native-
float32` (the baseline's weights computing in fp32, i.e. how far bf16 itself is from fp32)
and `int4-g16` (the same linears through a plain 4-bit format, to tell NVFP4's cost from 4
bits' cost on this model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from libs.engine.engine import DecodeSeq, Engine  # noqa: E402
from libs.engine.kvpool import KvPool  # noqa: E402
from libs.engine.loader import LoadedModel, load_model  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is 17 multiplied by 23? Show your working.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for sleeping better.",
    "Translate 'Where is the train station?' into Spanish and French.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the difference between a virus and a bacterium?",
    "If I have 5 apples and give away 2, then buy 4 more, how many do I have?",
    "Write a short, polite email declining a meeting invitation.",
    "List the planets of the solar system in order from the Sun.",
    "Explain what a hash table is to a beginner programmer.",
    "Describe the taste of a lemon to someone who has never had one.",
    "What are the main causes of the French Revolution?",
    "Write a limerick about a cat who loves to code.",
    "How does photosynthesis work?",
    "Give me a recipe for a simple tomato pasta sauce.",
    "What is the Pythagorean theorem? Give an example.",
    "Suggest a name for a bakery and explain why it works.",
]

Variant = Callable[[list[int], list[int]], torch.Tensor]
Hook = Callable[[Engine, list[int], int], None]


def make_engine(loaded: LoadedModel, tokens: int) -> Engine:
    longest = max(len(p) for p in PROMPTS) * 4 + tokens  # chat template + prompt, generous
    pool = KvPool(loaded.config, longest // 16 + 2, 16, dtype=loaded.weights.dtype)
    return Engine(loaded.config, loaded.weights, pool)


def teacher_forced(
    engine: Engine, prompt: list[int], tokens: list[int], after_prefill: Hook | None = None
) -> torch.Tensor:
    """Logits [len(tokens), vocab] (fp32) predicting each of `tokens` after the prompt and the
    tokens before it: one prefill, then a decode step per token, as serving computes them."""
    pages = engine.pool.alloc(engine.pool.pages_for(len(prompt) + len(tokens)))
    try:
        out = [engine.prefill(prompt, pages)]
        if after_prefill is not None:
            after_prefill(engine, pages, len(prompt))
        for i, token in enumerate(tokens[:-1]):
            out.append(engine.decode_step([DecodeSeq(pages, len(prompt) + i, token)])[0])
        return torch.stack(out).float()
    finally:
        engine.pool.free(pages)


def greedy(
    engine: Engine, prompt: list[int], n: int, eos: set[int]
) -> tuple[list[int], torch.Tensor]:
    """The baseline: up to n greedy tokens (EOS ends it and is scored) and their logits."""
    pages = engine.pool.alloc(engine.pool.pages_for(len(prompt) + n))
    try:
        logits, tokens = [engine.prefill(prompt, pages)], []
        while True:
            tokens.append(int(logits[-1].argmax()))
            if tokens[-1] in eos or len(tokens) == n:
                return tokens, torch.stack(logits).float()
            step = DecodeSeq(pages, len(prompt) + len(tokens) - 1, tokens[-1])
            logits.append(engine.decode_step([step])[0])
    finally:
        engine.pool.free(pages)


def compare(base: torch.Tensor, var: torch.Tensor, tokens: list[int]) -> dict:
    """Per-position agreement and KL(base || var) of one sequence."""
    p = torch.log_softmax(base.double(), -1)
    q = torch.log_softmax(var.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
    agree = var.argmax(-1) == torch.tensor(tokens)
    return {"positions": len(tokens), "agree": int(agree.sum()), "kl": kl.tolist()}


def score(variant: Variant, cases: list[dict]) -> dict:
    """Run `variant` over the baseline's cases; per-prompt rows and pooled summary."""
    rows, all_kl, agree, positions = [], [], 0, 0
    t0 = time.perf_counter()
    for case in cases:
        logits = variant(case["prompt_ids"], case["tokens"])
        r = compare(case["logits"], logits, case["tokens"])
        rows.append({
            "prompt": case["prompt"], "positions": r["positions"],
            "agreement": r["agree"] / r["positions"],
            "mean_kl": sum(r["kl"]) / r["positions"], "max_kl": max(r["kl"]),
        })
        all_kl += r["kl"]
        agree += r["agree"]
        positions += r["positions"]
    kl = torch.tensor(all_kl, dtype=torch.float64)
    summary = {
        "positions": positions, "agreement": agree / positions, "mean_kl": kl.mean().item(),
        "median_kl": kl.median().item(), "p95_kl": kl.quantile(0.95).item(),
        "max_kl": kl.max().item(), "seconds": time.perf_counter() - t0,
    }
    return {"rows": rows, "summary": summary}


def weights_nvfp4(args: argparse.Namespace, base: Engine) -> tuple[str, Variant]:
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), weights_format="nvfp4")
    engine = make_engine(loaded, args.tokens)
    return (f"--weights nvfp4: the same fp32 weights with every layer's q/k/v/o/gate/up/down "
            f"quantized to NVFP4 (embeddings, norms, lm_head as the baseline), {args.dtype} "
            "compute", partial(teacher_forced, engine))


def native_float32(args: argparse.Namespace, base: Engine) -> tuple[str, Variant]:
    loaded = load_model(args.model, dtype=torch.float32)
    engine = make_engine(loaded, args.tokens)
    return ("native weights computing in float32 (context: the baseline's own dtype error)",
            partial(teacher_forced, engine))


def int4_g16(args: argparse.Namespace, base: Engine) -> tuple[str, Variant]:
    """Context for the NVFP4 figures: the same linears through another 4-bit format, symmetric
    INT4 (-7..7) with one fp32 absmax scale per 16 weights (fake-quantized, dense)."""
    from dataclasses import replace

    from libs.engine.nvfp4 import LINEARS

    def fake_int4(w: torch.Tensor) -> torch.Tensor:
        blocks = w.unflatten(-1, (-1, 16))
        scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 7
        return ((blocks / scale).round().clamp(-7, 7) * scale).flatten(-2)

    loaded = load_model(args.model, dtype=torch.float32)
    w = loaded.weights
    layers = [replace(lw, **{f: fake_int4(getattr(lw, f)) for f in LINEARS}) for lw in w.layers]
    dense = replace(w, layers=layers).to("cpu", getattr(torch, args.dtype))
    loaded = replace(loaded, weights=dense)
    engine = make_engine(loaded, args.tokens)
    return (f"context: the same linears in symmetric INT4 with an fp32 scale per 16 weights, "
            f"{args.dtype} compute", partial(teacher_forced, engine))


def kv_nvfp4(args: argparse.Namespace, base: Engine) -> tuple[str, Variant]:
    """`--kv-transfer nvfp4`: the baseline engine, whose prompt KV pages take the NVFP4 page
    round trip of the transfer (libs/transfer/staging.KvWire) between prefill and decode.
    The first token comes from the prefill's native KV, as on the prefill."""
    from bench.nvfp4_kv_quality import through
    from libs.transfer.staging import KvWire

    transfer = through(KvWire("nvfp4", base.pool.tensor))  # the one round trip both benches use

    def round_trip(engine: Engine, pages: list[int], n_prompt: int) -> None:
        prompt_pages = pages[: engine.pool.pages_for(n_prompt)]
        transfer(prompt_pages, n_prompt - (len(prompt_pages) - 1) * engine.pool.page_size)

    return (f"--kv-transfer nvfp4: native weights, the prompt's KV pages quantized to NVFP4 "
            f"and back as the transfer does, {args.dtype} compute",
            partial(teacher_forced, base, after_prefill=round_trip))


VARIANTS: dict[str, Callable[[argparse.Namespace, Engine], tuple[str, Variant]]] = {
    "weights-nvfp4": weights_nvfp4,
    "kv-nvfp4": kv_nvfp4,
    "native-float32": native_float32,
    "int4-g16": int4_g16,
}


def print_table(name: str, result: dict) -> None:
    print(f"\n== {name}")
    print(f"{'#':>2}  {'prompt':<44} {'pos':>4} {'agree':>7} {'mean KL':>9} {'max KL':>8}")
    for i, r in enumerate(result["rows"]):
        prompt = r["prompt"] if len(r["prompt"]) <= 44 else r["prompt"][:41] + "..."
        print(f"{i:>2}  {prompt:<44} {r['positions']:>4} {r['agreement']:>7.1%} "
              f"{r['mean_kl']:>9.4f} {r['max_kl']:>8.3f}")
    s = result["summary"]
    print(f"{'':>2}  {'ALL (pooled over positions)':<44} {s['positions']:>4} "
          f"{s['agreement']:>7.1%} {s['mean_kl']:>9.4f} {s['max_kl']:>8.3f}")
    print(f"    KL median {s['median_kl']:.4f}, p95 {s['p95_kl']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the baseline's (and the variants') compute dtype (default bfloat16)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (64)")
    ap.add_argument("--variants", default="weights-nvfp4",
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default weights-nvfp4)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench-results/nvfp4_quality_<dtype>.json)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    native = load_model(args.model, dtype=getattr(torch, args.dtype))
    base = make_engine(native, args.tokens)
    tok = native.tokenizer
    eos = set(native.config.eos_token_ids)
    cases = []
    t0 = time.perf_counter()
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        tokens, logits = greedy(base, ids, args.tokens, eos)
        cases.append({"prompt": prompt, "prompt_ids": ids, "tokens": tokens, "logits": logits})
    baseline_s = time.perf_counter() - t0
    result = {
        "model": args.model, "dtype": args.dtype, "tokens": args.tokens,
        "prompts": len(PROMPTS), "chat_template": True, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "baseline": f"native engine ({args.model} GGUF Q4_1 dequantized to fp32, cast to "
                    f"{args.dtype}), greedy up to {args.tokens} tokens, EOS ends and is scored",
        "baseline_seconds": baseline_s,
        "sample_outputs": {c["prompt"]: tok.decode(c["tokens"]) for c in cases[:3]},
        "variants": {},
    }
    for name in names:
        description, variant = VARIANTS[name](args, base)
        res = score(variant, cases)
        result["variants"][name] = {"description": description, **res}
        print_table(f"{name}: {description}", res)
    out = Path(args.out or f"bench-results/nvfp4_quality_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
