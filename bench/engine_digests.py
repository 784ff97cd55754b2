"""Greedy tokens of pdmesh's engine with --weights nvfp4, to compare two trees bit for bit.

Run from the root of the tree under test (PYTHONPATH=. makes its `libs` the one imported),
with this file's path, so one copy of the script checks any two trees:

    PYTHONPATH=. python3 /path/to/bench/engine_digests.py --out new.json
    PYTHONPATH=. python3 /path/to/bench/engine_digests.py --device cpu --tokens 8 --out smoke.json
    PYTHONPATH=. python3 /path/to/bench/engine_digests.py --compare old.json new.json

It loads `random:smollm2` (SmolLM2-135M's shape, seeded random weights) as
`pdmesh decode --model random:smollm2 --weights nvfp4` does (libs.engine.loader.load_model
with weights_format="nvfp4": the layer linears quantized on the CPU in fp32, then moved to
the device in --dtype), and generates greedily (argmax of the fp32 logits):

- each of three fixed prompts (token ids, no tokenizer: 5, 40 and 600 tokens) alone, its
  prompt in one prefill, then one decode step a token;
- the three together: each prompt prefilled alone, then decode steps of the batch of 3;
- the three prompts packed into one prefill (prefill_batch, 645 tokens), then decode
  steps of the batch of 3.

So the NVFP4 linears run at 1 and 3 tokens (decode) and 5, 40, 600 and 645 (prefill): on
CUDA in bf16 that is the small kernel, the phased kernel, the Triton kernel, the GEMM and
the dequantize route. The JSON holds the tokens and a sha256 of every step's logits, in
order: two trees whose kernels give the same bits give the same file.

Only engine API present both before and after the NVFP4 kernel cut is used: load_model,
KvPool, Engine.prefill / prefill_batch / decode_step, DecodeSeq, PrefillSeq.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from libs.engine.engine import DecodeSeq, Engine, PrefillSeq
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model

PROMPT_LENGTHS = (5, 40, 600)
PAGE_SIZE = 16


def prompts(vocab: int) -> list[list[int]]:
    """Three fixed prompts of token ids (seeded; ids 3.. so no special token is used)."""
    g = torch.Generator().manual_seed(51)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


class Digest:
    """sha256 over the fp32 logits of every step, in order."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def add(self, logits: torch.Tensor) -> None:
        self.h.update(logits.detach().float().contiguous().cpu().numpy().tobytes())

    def hex(self) -> str:
        return self.h.hexdigest()


def greedy(logits: torch.Tensor) -> list[int]:
    """Argmax of [B, vocab] or [vocab] logits (the first index on a tie)."""
    return torch.atleast_2d(logits).float().argmax(-1).tolist()


def decode_batch(engine: Engine, pool: KvPool, pages: list[list[int]], pos: list[int],
                 first: list[int], n_tokens: int, digest: Digest) -> list[list[int]]:
    """n_tokens greedy tokens for each sequence, the first given, decoded together."""
    out = [[t] for t in first]
    for _ in range(n_tokens - 1):
        seqs = [DecodeSeq(p, q, o[-1]) for p, q, o in zip(pages, pos, out, strict=True)]
        logits = engine.decode_step(seqs)
        digest.add(logits)
        for o, t in zip(out, greedy(logits), strict=True):
            o.append(t)
        pos = [q + 1 for q in pos]
    return out


def run(device: str, dtype: torch.dtype, n_tokens: int) -> dict:
    loaded = load_model("random:smollm2", device=device, dtype=dtype, weights_format="nvfp4")
    config = loaded.config
    ps = prompts(config.vocab_size)
    per_seq = -(-(max(PROMPT_LENGTHS) + n_tokens) // PAGE_SIZE)
    pool = KvPool(config, 3 * per_seq + 8, PAGE_SIZE, device=device, dtype=loaded.weights.dtype)
    engine = Engine(config, loaded.weights, pool)
    result: dict = dict(device=str(torch.device(device)), dtype=str(dtype).removeprefix("torch."),
                        weights_format=loaded.weights_format, prompt_lengths=PROMPT_LENGTHS,
                        tokens_per_prompt=n_tokens)
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(device))

    def pages_of(prompt: list[int]) -> list[int]:
        return pool.alloc(pool.pages_for(len(prompt) + n_tokens))

    # each prompt alone
    alone, digest = [], Digest()
    for p in ps:
        pages = pages_of(p)
        logits = engine.prefill(p, pages, 0)
        digest.add(logits)
        alone.append(decode_batch(engine, pool, [pages], [len(p)], greedy(logits), n_tokens,
                                  digest)[0])
        pool.free(pages)
    result["alone"] = dict(tokens=alone, logits_sha256=digest.hex())

    # prefilled one by one, decoded as a batch of 3
    digest = Digest()
    pages = [pages_of(p) for p in ps]
    first = []
    for p, pg in zip(ps, pages, strict=True):
        logits = engine.prefill(p, pg, 0)
        digest.add(logits)
        first += greedy(logits)
    batch = decode_batch(engine, pool, pages, [len(p) for p in ps], first, n_tokens, digest)
    for pg in pages:
        pool.free(pg)
    result["batch"] = dict(tokens=batch, logits_sha256=digest.hex())

    # one packed prefill of all three, decoded as a batch of 3
    digest = Digest()
    pages = [pages_of(p) for p in ps]
    logits = engine.prefill_batch([PrefillSeq(p, pg, 0) for p, pg in zip(ps, pages, strict=True)])
    digest.add(logits)
    packed = decode_batch(engine, pool, pages, [len(p) for p in ps], greedy(logits), n_tokens,
                          digest)
    for pg in pages:
        pool.free(pg)
    result["packed_prefill"] = dict(tokens=packed, logits_sha256=digest.hex())
    return result


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bad = 0
    for key in ("alone", "batch", "packed_prefill"):
        same_tokens = a[key]["tokens"] == b[key]["tokens"]
        same_logits = a[key]["logits_sha256"] == b[key]["logits_sha256"]
        print(f"{key}: tokens {'equal' if same_tokens else 'DIFFER'}, "
              f"logits {'bit-equal' if same_logits else 'DIFFER'}")
        bad += not (same_tokens and same_logits)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two outputs")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out is required unless --compare")
    t0 = time.time()
    with torch.inference_mode():
        result = run(args.device, getattr(torch, args.dtype), args.tokens)
    result["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for key in ("alone", "batch", "packed_prefill"):
        print(key, result[key]["logits_sha256"][:16], [t[:8] for t in result[key]["tokens"]])
    print(f"{result['seconds']} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
