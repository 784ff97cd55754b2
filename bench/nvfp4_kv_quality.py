"""How much `--kv-transfer nvfp4` changes what the model generates, and the bytes it saves.

Colocated (no mesh, no NIXL), exactly what the transfer does to a request: the prefill
computes the prompt's KV natively and samples the first token from its own logits; the
prompt's KV pages then go through the NVFP4 page round trip (`KvWire.pack` into wire
slots, `KvWire.unpack` back into the pages, the code the prefill and decode run); every
later token's KV is computed by the decode and stays native.

For each of 16 fixed chat prompts, the native engine generates 64 greedy tokens. The same
sequence is then scored with the round-tripped prompt KV (teacher forcing: the native
tokens are fed back), giving per position the greedy-token agreement (argmax equals the
native token) and KL(native || nvfp4-KV) of the next-token distributions. Position 0 (the
first token) comes from the prefill's logits over native KV on both paths, so it is left
out: 63 positions per prompt. A free-running nvfp4 greedy run also reports how many
tokens match the native continuation before the first difference.

Transfer bytes: per request of a 512-token prompt, native (fp32 and bf16 pools) against
nvfp4, from the wire format's sizes on the model's KV shape; with ``--mesh``, also measured
on real meshes (`pdmesh up --kv-transfer native|nvfp4`, fp32 and bf16): the prefill's
``pdmesh_kv_transfer_bytes`` histogram sum across one 512-token request.

    python -m bench.nvfp4_kv_quality [--model smollm2] [--breakdown] [--mesh]
        [--out bench-results/nvfp4_kv_quality.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from libs.engine.engine import DecodeSeq, Engine  # noqa: E402
from libs.engine.kvpool import KvPool  # noqa: E402
from libs.engine.loader import load_model  # noqa: E402
from libs.transfer.kvwire import Nvfp4PageFormat  # noqa: E402
from libs.transfer.staging import KvWire  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how a bicycle works.",
    "Give me a list of ten fruits and one sentence about each.",
    "How do airplanes stay in the air?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "Explain what a neural network is in simple terms.",
    "Give three tips for learning a new language.",
    "Why is the sky blue?",
    "Write a polite email declining a meeting invitation.",
    "What causes the seasons on Earth?",
    "List the planets of the solar system in order from the Sun.",
]
NEW_TOKENS = 64
CHUNK = 256  # the prefill's default --chunk-tokens
BYTES_PROMPT = 512


# What happens to the prompt's KV pages between prefill and decode: (pages, tokens in last).
Transfer = Callable[[list[int], int], None]


def through(wire: KvWire) -> Transfer:
    """The mesh's transfer minus NIXL: pack into the wire slots, unpack into the pages."""
    def transfer(pages: list[int], last_page_tokens: int) -> None:
        wire.pack(pages, last_page_tokens)
        wire.unpack(pages)
    return transfer


def prefill(engine: Engine, prompt: Sequence[int], pages: list[int],
            wire: KvWire | Transfer | None) -> torch.Tensor:
    """Chunked prefill; with ``wire``, the prompt's pages then travel as the mesh sends them.

    Returns the prefill's last logits (computed over native KV, as on the prefill).
    """
    pool = engine.pool
    for start in range(0, len(prompt), CHUNK):
        logits = engine.prefill(prompt[start : start + CHUNK], pages, start)
    if wire is not None:
        transfer = through(wire) if isinstance(wire, KvWire) else wire
        prompt_pages = pages[: pool.pages_for(len(prompt))]
        transfer(prompt_pages, len(prompt) - (len(prompt_pages) - 1) * pool.page_size)
    return logits


def only(part: int, wire: KvWire) -> Transfer:
    """Diagnostic: the NVFP4 round trip applied to K (part 0) or V (part 1) only."""
    fmt, pool = wire.format, wire.pool

    def transfer(pages: list[int], last_page_tokens: int) -> None:
        kv = pool[pages]
        pool[pages, :, part] = fmt.roundtrip(kv, last_page_tokens)[:, :, part]
    return transfer


def bf16_cast(wire: KvWire) -> Transfer:
    """Reference point: the prompt's KV cast to bfloat16 and back (a bf16 pool's loss)."""
    pool = wire.pool

    def transfer(pages: list[int], last_page_tokens: int) -> None:
        pool[pages] = pool[pages].to(torch.bfloat16).to(pool.dtype)
    return transfer


def run(engine: Engine, prompt: Sequence[int], new_tokens: int,
        wire: KvWire | Transfer | None,
        forced: Sequence[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from (fp32 [vocab]).

    ``forced``: feed these tokens instead of the argmax (teacher forcing); logits are still
    those the model produced at each position. EOS does not stop: every run has
    ``new_tokens`` positions, so runs compare position by position.
    """
    pool = engine.pool
    pages = pool.alloc(pool.pages_for(len(prompt) + new_tokens))
    try:
        logits = prefill(engine, prompt, pages, wire)
        tokens, all_logits = [], []
        pos = len(prompt)
        for i in range(new_tokens):
            all_logits.append(logits.float())
            token = int(forced[i]) if forced is not None else int(torch.argmax(logits))
            tokens.append(token)
            if i + 1 < new_tokens:
                logits = engine.decode_step([DecodeSeq(pages, pos, token)])[0]
                pos += 1
        return tokens, all_logits
    finally:
        pool.free(pages)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) in nats, from logits, in float64."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def score(engine: Engine, wire: KvWire, prompt: Sequence[int], new_tokens: int,
          variants: dict[str, Transfer] | None = None) -> dict:
    native, native_logits = run(engine, prompt, new_tokens, None)
    _, nv_logits = run(engine, prompt, new_tokens, wire, forced=native)
    free, _ = run(engine, prompt, new_tokens, wire)
    positions = range(1, new_tokens)  # 0 is the prefill's token: native KV on both paths
    kls = [kl(native_logits[i], nv_logits[i]) for i in positions]
    agree = [int(torch.argmax(nv_logits[i])) == native[i] for i in positions]
    same_prefix = next((i for i, (a, b) in enumerate(zip(native, free, strict=True)) if a != b),
                       new_tokens)
    breakdown = {}
    for name, transfer in (variants or {}).items():
        _, logits = run(engine, prompt, new_tokens, transfer, forced=native)
        v_kls = [kl(native_logits[i], logits[i]) for i in positions]
        v_agree = [int(torch.argmax(logits[i])) == native[i] for i in positions]
        breakdown[name] = {"agreement": sum(v_agree) / len(v_agree),
                           "mean_kl": sum(v_kls) / len(v_kls)}
    return {
        "variants": breakdown,
        "prompt_tokens": len(prompt),
        "positions": len(kls),
        "agreement": sum(agree) / len(agree),
        "mean_kl": sum(kls) / len(kls),
        "max_kl": max(kls),
        "free_running_same_prefix": same_prefix,
        "free_running_identical": same_prefix == new_tokens,
        "first_token_equal": native[0] == free[0],
    }


def transfer_bytes(config, page_size: int, prompt_tokens: int) -> dict:
    fmt = Nvfp4PageFormat(config.n_layers, config.n_kv_heads, page_size, config.head_dim)
    pages = -(-prompt_tokens // page_size)
    elements = config.n_layers * 2 * config.n_kv_heads * page_size * config.head_dim
    per_page = {"fp32": elements * 4, "bf16": elements * 2, "nvfp4": fmt.slot_bytes}
    return {
        "prompt_tokens": prompt_tokens,
        "pages": pages,
        "page_size": page_size,
        "bytes_per_page": per_page,
        "bytes_per_request": {k: v * pages for k, v in per_page.items()},
        "nvfp4_layout": {"packed": fmt.packed_bytes, "scales": fmt.scales_bytes,
                         "s2": fmt.s2_bytes, "padding": fmt.slot_bytes - fmt.payload_bytes},
        "ratio_vs_bf16": per_page["bf16"] / fmt.slot_bytes,
        "ratio_vs_fp32": per_page["fp32"] / fmt.slot_bytes,
    }


def mesh_bytes(model: str, kv_transfer: str, dtype: str, prompt_tokens: int) -> dict:
    """Start a mesh, send one prompt of ``prompt_tokens`` tokens, read the prefill's bytes."""
    import tempfile
    import urllib.request

    import anyio

    from pdmesh.client import GenerateClient
    from pdmesh.localmesh import start_mesh

    def transfer_bytes_sum(url: str) -> float:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("pdmesh_kv_transfer_bytes_sum"))

    async def one(router: str) -> None:
        async with GenerateClient(router) as client:
            async for _ in client.generate(prompt=" river" * prompt_tokens, max_tokens=1):
                pass

    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp), model=model, dtype=dtype,
                          up_args=["--kv-transfer", kv_transfer])
        try:
            started = mesh.status()
            prefill = next(m for m in started["members"] if m["role"] == "prefill")
            before = transfer_bytes_sum(prefill["metrics"])
            anyio.run(one, mesh.router)
            after = transfer_bytes_sum(prefill["metrics"])
        finally:
            mesh.stop()
    return {"kv_transfer": kv_transfer, "dtype": dtype, "bytes": int(after - before)}


def summarize(rows: list[dict], variants: dict | None, seconds: float) -> dict:
    """Totals over every scored position (each prompt weighs by its positions)."""
    n_pos = sum(r["positions"] for r in rows)

    def mean(get) -> float:
        return sum(get(r) * r["positions"] for r in rows) / n_pos

    return {
        "prompts": len(rows),
        "positions": n_pos,
        "agreement": mean(lambda r: r["agreement"]),
        "mean_kl": mean(lambda r: r["mean_kl"]),
        "max_kl": max(r["max_kl"] for r in rows),
        "free_running_identical": sum(r["free_running_identical"] for r in rows),
        "variants": {
            name: {key: mean(lambda r, name=name, key=key: r["variants"][name][key])
                   for key in ("agreement", "mean_kl")}
            for name in (variants or {})
        },
        "seconds": seconds,
    }


def print_quality(rows: list[dict], summary: dict, new_tokens: int) -> None:
    print(f"{'#':>2} {'prompt':<44} {'ptok':>4} {'agree':>6} {'mean KL':>9} {'max KL':>8} "
          f"{'same prefix':>11}")
    for i, r in enumerate(rows):
        print(f"{i:>2} {r['prompt'][:44]:<44} {r['prompt_tokens']:>4} {r['agreement']:>6.1%} "
              f"{r['mean_kl']:>9.2e} {r['max_kl']:>8.2e} "
              f"{r['free_running_same_prefix']:>5}/{new_tokens}")
    print(f"all: {summary['positions']} positions, greedy agreement {summary['agreement']:.2%}, "
          f"mean KL {summary['mean_kl']:.3e} nats, max KL {summary['max_kl']:.3e}; "
          f"{summary['free_running_identical']}/{summary['prompts']} free-running continuations "
          f"identical ({summary['seconds']:.0f} s)")
    for name, v in summary["variants"].items():
        print(f"  for comparison, {name:<13}: greedy agreement {v['agreement']:.2%}, "
              f"mean KL {v['mean_kl']:.3e} nats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | PATH")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--breakdown", action="store_true",
                        help="also score NVFP4 on K only, on V only, and a bf16 cast of the KV")
    parser.add_argument("--mesh", action="store_true",
                        help="also measure the bytes of one 512-token request on real meshes")
    parser.add_argument("--out", default="bench-results/nvfp4_kv_quality.json")
    args = parser.parse_args()

    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    cfg = loaded.config
    pool = KvPool(cfg, 64, args.page_size, dtype=loaded.weights.dtype)
    engine = Engine(cfg, loaded.weights, pool)
    wire = KvWire("nvfp4", pool.tensor)
    variants = {"nvfp4 K only": only(0, wire), "nvfp4 V only": only(1, wire),
                "bf16 cast": bf16_cast(wire)} if args.breakdown else None
    started = time.perf_counter()
    rows = []
    for text in PROMPTS[: args.prompts]:
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        rows.append({"prompt": text, **score(engine, wire, prompt, args.new_tokens, variants)})
    summary = summarize(rows, variants, time.perf_counter() - started) if rows else None
    sizes = transfer_bytes(cfg, args.page_size, BYTES_PROMPT)

    print(f"model {args.model}, engine dtype {args.dtype} on {engine.device} "
          f"(torch {torch.__version__}, {torch.get_num_threads()} threads); "
          f"{args.new_tokens} greedy tokens per prompt, positions 1..{args.new_tokens - 1}")
    if summary is not None:
        print_quality(rows, summary, args.new_tokens)
    print()
    print(f"transfer bytes, {BYTES_PROMPT}-token prompt ({sizes['pages']} pages of "
          f"{args.page_size} tokens), {cfg.n_layers} layers x {cfg.n_kv_heads} kv heads x "
          f"head_dim {cfg.head_dim}:")
    print(f"{'format':<8} {'bytes/page':>11} {'bytes/request':>14} {'vs nvfp4':>9}")
    for k in ("fp32", "bf16", "nvfp4"):
        b = sizes["bytes_per_page"][k]
        print(f"{k:<8} {b:>11,} {sizes['bytes_per_request'][k]:>14,} "
              f"{b / sizes['bytes_per_page']['nvfp4']:>8.2f}x")

    measured = []
    if args.mesh:
        tokenizer = loaded.tokenizer
        assert len(tokenizer.encode(" river" * BYTES_PROMPT)) == BYTES_PROMPT
        print(f"measured on meshes ({args.model}, one {BYTES_PROMPT}-token request, "
              f"prefill's pdmesh_kv_transfer_bytes):")
        for dtype, kv_transfer in (("float32", "native"), ("bfloat16", "native"),
                                   ("float32", "nvfp4"), ("bfloat16", "nvfp4")):
            m = mesh_bytes(args.model, kv_transfer, dtype, BYTES_PROMPT)
            measured.append(m)
            print(f"  --dtype {dtype:<8} --kv-transfer {kv_transfer:<6} {m['bytes']:>12,} bytes "
                  f"= {m['bytes'] / sizes['pages']:>9,.0f} per page")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": args.model, "dtype": args.dtype, "device": str(engine.device),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "new_tokens": args.new_tokens,
        "summary": summary, "rows": rows, "transfer_bytes": sizes,
        "measured_mesh_bytes": measured,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
