"""`pdmesh bench --workload multiturn`: agentic conversations, prefix cache on vs off.

``--conversations`` conversations of ``--turns`` turns each; the first message has about
``--opening-words`` words (an agent's instructions and context), and every later turn
resends the whole conversation so far (the previous prompt, the answer, then a new user
message of about ``--turn-words`` words), so prompts grow turn by turn, the way agents
resend their history. ``--concurrency`` conversations are in flight at once, each one
turn at a time. The same conversations run against two meshes started one after the other, the first
with ``--prefix-cache off`` and the second with ``on`` (same model, same flags else).

Per side it reports TTFT p50 per turn index and of turns 2.., the prompt tokens the
prefills computed, the KV bytes moved to the decodes and those skipped (the decode held
them), the members' prefix-cache hit rates, and whether the greedy tokens of every turn
are identical on both sides. With several prefills or decodes (``--prefill N --decode N``)
it also reports where the router placed the turns (``pdmesh_kv_routes_total``: landed on
the pair holding the most of the prompt's KV, elsewhere, or cold) and the requests each
member served, and their spread (most over fewest, per role). Prints a table, writes the
JSON to ``--out``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from pdmesh.bench.prompts import OBJECTS, SUBJECTS, VERBS


@dataclass
class Turn:
    ttft: float | None = None
    tokens: list[int] = field(default_factory=list)
    error: str = ""


def user_message(conversation: int, turn: int, words: int) -> str:
    """About ``words`` words of a user turn, distinct per conversation and turn."""
    out, i = [f"Conversation {conversation}, message {turn}:"], 0
    while sum(len(s.split()) for s in out) < words:
        out.append(f"the {SUBJECTS[(i + turn) % 8]} {VERBS[(i + conversation) % 7]} "
                   f"{OBJECTS[(3 * i + turn) % 5]} at marker {7 * i + 31 * conversation}.")
        i += 1
    return " ".join(out)


async def _conversations(router: str, n: int, turns: int, opening: int, words: int,
                         max_tokens: int, concurrency: int) -> list[list[Turn]]:
    from pdmesh.client import GenerateClient, Piece

    results: list[list[Turn]] = [[] for _ in range(n)]
    pending = iter(range(n))
    async with GenerateClient(router, timeout=600.0) as client:
        model = (await client.models())[0]

        async def one(c: int) -> None:
            history = ""
            for t in range(turns):
                message = user_message(c, t, opening if t == 0 else words)
                history += f"\nUser: {message}\nAssistant:"
                turn, text = Turn(), ""
                start = time.perf_counter()
                try:
                    async for event in client.generate(model=model, prompt=history,
                                                       max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True):
                        if isinstance(event, Piece):
                            if turn.ttft is None:
                                turn.ttft = time.perf_counter() - start
                            turn.tokens += event.token_ids
                            text += event.text
                except Exception as e:  # recorded, the conversation goes on
                    turn.error = type(e).__name__
                results[c].append(turn)
                history += text

        async def worker() -> None:
            for c in pending:
                await one(c)

        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, n)):
                tg.start_soon(worker)
    return results


def _members(status: dict) -> dict[str, dict]:
    return {m["name"]: m for m in status["members"] if m["role"] in ("prefill", "decode")}


def _delta(before: dict, after: dict, role: str, key: str) -> int:
    return sum((after[n].get(key) or 0) - (before[n].get(key) or 0)
               for n in after if after[n]["role"] == role and n in before)


def _routes(mesh) -> dict[str, float]:
    """The router's pdmesh_kv_routes_total by outcome."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{mesh.http_port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdmesh_kv_routes_total{"):
            [outcome] = re.findall(r'outcome="([^"]*)"', line)
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def _placement(before: dict, after: dict, routes0: dict, routes1: dict) -> dict:
    routes = {k: routes1.get(k, 0) - routes0.get(k, 0) for k in ("landed", "elsewhere", "cold")}
    warm = routes["landed"] + routes["elsewhere"]
    served = {n: (after[n].get("requests_total") or 0) - (before[n].get("requests_total") or 0)
              for n in after if n in before}
    spread = {}
    for role in ("prefill", "decode"):
        counts = [served[n] for n in served if after[n]["role"] == role]
        spread[role] = max(counts) / min(counts) if counts and min(counts) else None
    return {"routes": routes, "landed_rate": routes["landed"] / warm if warm else None,
            "requests_by_member": served, "requests_spread": spread}


def side(args, cache: str, out_dir: Path) -> dict:
    """Start a mesh with --prefix-cache ``cache``, run the conversations, stop it."""
    from pdmesh.localmesh import start_mesh, wait_quiet

    up = [*shlex.split(args.mesh_args), "--prefix-cache", cache]
    mesh = start_mesh(out_dir, model=args.model, device=args.device, timeout=300.0,
                      up_args=up, prefill=args.prefill, decode=args.decode)
    try:
        before = _members(mesh.status())
        routes0 = _routes(mesh)
        t0 = time.perf_counter()
        convs = anyio.run(_conversations, f"127.0.0.1:{mesh.grpc_port}", args.conversations,
                          args.turns, args.opening_words, args.turn_words, args.turn_tokens,
                          args.concurrency)
        wall = time.perf_counter() - t0
        after = _members(wait_quiet(mesh, 30.0))
        routes1 = _routes(mesh)
    finally:
        mesh.stop()
    per_turn = []
    for t in range(args.turns):
        ttfts = [c[t].ttft for c in convs if len(c) > t and c[t].ttft is not None]
        per_turn.append(statistics.median(ttfts) if ttfts else None)
    later = [c[t].ttft for c in convs for t in range(1, len(c)) if c[t].ttft is not None]
    asked = _delta(before, after, "prefill", "prefix_cache_query_tokens_total")
    hits = _delta(before, after, "prefill", "prefix_cache_hits_total")
    d_asked = _delta(before, after, "decode", "prefix_cache_query_tokens_total")
    d_hits = _delta(before, after, "decode", "prefix_cache_hits_total")
    return {
        "prefix_cache": cache,
        "wall_s": wall,
        "errors": sum(1 for c in convs for t in c if t.error),
        "ttft_p50_by_turn_s": per_turn,
        "ttft_p50_turns_2_on_s": statistics.median(later) if later else None,
        "prompt_tokens_computed": _delta(before, after, "prefill",
                                         "prompt_tokens_computed_total"),
        "kv_bytes_moved": _delta(before, after, "prefill", "kv_transfer_bytes_moved_total"),
        "kv_bytes_skipped": _delta(before, after, "prefill",
                                   "kv_transfer_bytes_skipped_total"),
        "prefill_hit_rate": hits / asked if asked else None,
        "decode_hit_rate": d_hits / d_asked if d_asked else None,
        "kv_pages_used_after": sum(m["kv_pages_used"] or 0 for m in after.values()),
        "tokens": [[t.tokens for t in c] for c in convs],
        **_placement(before, after, routes0, routes1),
    }


def run(args) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sides = [side(args, cache, out.parent) for cache in ("off", "on")]
    off, on = sides
    identical = off["tokens"] == on["tokens"]
    for s in sides:
        del s["tokens"]
    result = {
        "workload": {"name": "multiturn", "conversations": args.conversations,
                     "turns": args.turns, "opening_words": args.opening_words,
                     "turn_words": args.turn_words,
                     "turn_tokens": args.turn_tokens, "concurrency": args.concurrency,
                     "model": args.model, "device": args.device, "mesh_args": args.mesh_args,
                     "prefill": args.prefill, "decode": args.decode},
        "greedy_tokens_identical": identical,
        "sides": sides,
    }
    out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"JSON: {out}")
    return 0 if identical and not off["errors"] and not on["errors"] else 1


def print_table(result: dict) -> None:
    def ms(v) -> str:
        return "-" if v is None else f"{1e3 * v:.0f}"

    def pct(v) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    w = result["workload"]
    print(f"multiturn: {w['conversations']} conversations x {w['turns']} turns, "
          f"{w['concurrency']} at a time, model {w['model']} on {w['device']}")
    turns = len(result["sides"][0]["ttft_p50_by_turn_s"])
    head = " ".join(f"{'turn ' + str(t + 1):>7}" for t in range(turns))
    print(f"{'cache':5} {head} {'2..':>7} {'computed':>9} {'KV moved MB':>11} "
          f"{'skipped MB':>10} {'hit P/D':>9} errors")
    for s in result["sides"]:
        cells = " ".join(f"{ms(v):>7}" for v in s["ttft_p50_by_turn_s"])
        print(f"{s['prefix_cache']:5} {cells} {ms(s['ttft_p50_turns_2_on_s']):>7} "
              f"{s['prompt_tokens_computed']:>9} {s['kv_bytes_moved'] / 1e6:>11.1f} "
              f"{s['kv_bytes_skipped'] / 1e6:>10.1f} "
              f"{pct(s['prefill_hit_rate']) + '/' + pct(s['decode_hit_rate']):>9} "
              f"{s['errors']}")
    print("TTFT p50 in ms per turn index; greedy tokens identical on both sides: "
          f"{result['greedy_tokens_identical']}")
    for s in result["sides"]:
        if len(s["requests_by_member"]) > 2:  # a choice of pairs: where did turns land?
            rate, spread = s["landed_rate"], s["requests_spread"]
            print(f"cache {s['prefix_cache']}: routes {s['routes']}, later turns landed "
                  f"{pct(rate)}; requests {s['requests_by_member']}, spread (most/fewest) "
                  + ", ".join(f"{r} {v:.2f}" if v else f"{r} -" for r, v in spread.items()))
