"""The mesh on a GPU: prefill and decode on cuda, KV moved VRAM to VRAM by NIXL.

    python -m bench.gpu_mesh_smoke [--weights native|nvfp4] [--kv-transfer native|nvfp4]

The default model is ``random:smollm2`` (seeded random weights of SmolLM2's shape), so no
checkpoint is needed on the GPU machine. Checks the mesh's greedy tokens equal the colocated
engine's on the same device and weights, and prints TTFT and decode tokens/s. Writes JSON to
--out; exits 1 when the tokens differ.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402

from pdmesh.client import Done, GenerateClient  # noqa: E402
from pdmesh.localmesh import start_mesh, wait_quiet  # noqa: E402

PROMPTS = ["The quick brown fox", "In a distant galaxy", "def fibonacci(n):"]


async def one(router: str, prompt: str, tokens: int) -> dict:
    ids: list[int] = []
    started = time.perf_counter()
    first = last = None
    async with GenerateClient(router) as client:
        async for item in client.generate(
            prompt=prompt, max_tokens=tokens, temperature=0, ignore_eos=True
        ):
            now = time.perf_counter()
            if isinstance(item, Done):
                break
            first = first or now
            last = now
            ids.extend(item.token_ids)
    return {
        "ids": ids,
        "ttft_s": first - started,
        "decode_tok_s": (len(ids) - 1) / (last - first) if last > first else None,
    }


def colocated(model: str, device: str, prompts: list[str], tokens: int, dtype: str,
              weights: str, kv_transfer: str) -> list[list[int]]:
    """The same requests on one engine; with nvfp4 KV, the prompt's pages take the same
    NVFP4 round trip the transfer gives them."""
    import torch

    from bench.nvfp4_kv_quality import prefill
    from libs.engine.engine import DecodeSeq, Engine
    from libs.engine.kvpool import KvPool
    from libs.engine.loader import load_model
    from libs.transfer.staging import KvWire

    loaded = load_model(model, device=device, dtype=getattr(torch, dtype),
                        weights_format=weights)
    pool = KvPool(loaded.config, 256, 16, device=device, dtype=loaded.weights.dtype)
    engine = Engine(loaded.config, loaded.weights, pool)
    wire = KvWire("nvfp4", pool.tensor) if kv_transfer == "nvfp4" else None
    out = []
    for text in prompts:
        prompt = loaded.tokenizer.encode(text)
        pages = pool.alloc(pool.pages_for(len(prompt) + tokens))
        logits = prefill(engine, prompt, pages, wire)
        ids, pos = [], len(prompt)
        while True:
            ids.append(int(logits.argmax()))
            if len(ids) == tokens:
                break
            logits = engine.decode_step([DecodeSeq(pages, pos, ids[-1])])[0]
            pos += 1
        pool.free(pages)
        out.append(ids)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:smollm2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights", default="native", choices=["native", "nvfp4"])
    parser.add_argument("--kv-transfer", default="native", choices=["native", "nvfp4"])
    parser.add_argument("--out", default="bench-results/gpu_mesh.json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    mesh = start_mesh(tmp, model=args.model, device=args.device, dtype=args.dtype, timeout=300,
                      up_args=["--weights", args.weights, "--kv-transfer", args.kv_transfer])
    try:
        runs = [anyio.run(one, mesh.router, p, args.tokens) for p in PROMPTS]
        status = wait_quiet(mesh, 2.0)
    finally:
        mesh.stop()
        print(mesh.log()[-2500:])
    local = colocated(args.model, args.device, PROMPTS, args.tokens, args.dtype, args.weights,
                      args.kv_transfer)
    equal = [r["ids"] == ids for r, ids in zip(runs, local, strict=True)]
    result = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "weights": args.weights,
        "kv_transfer": args.kv_transfer,
        "tokens": args.tokens,
        "greedy_equal_colocated": equal,
        "ttft_s": [r["ttft_s"] for r in runs],
        "decode_tok_s": [r["decode_tok_s"] for r in runs],
        "status_after": status,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "status_after"}, indent=2))
    return 0 if all(equal) else 1


if __name__ == "__main__":
    raise SystemExit(main())
