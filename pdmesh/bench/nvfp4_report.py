"""The markdown tables of `pdmesh bench --suite nvfp4` (nvfp4_suite.py) from its JSON."""

from __future__ import annotations


def _f(v, spec: str = ",.1f") -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a, b, spec: str = ".2f") -> str:
    return "-" if a is None or not b else format(a / b, spec) + "x"


def _get(d: dict, *keys):
    for k in keys:
        if isinstance(d, list) and isinstance(k, int) and k < len(d):
            d = d[k]
        elif isinstance(d, dict) and k in d:
            d = d[k]
        else:
            return None
    return d


def markdown(r: dict) -> str:
    bw = r.get("read_bandwidth") or {}
    lines = [
        f"# NVFP4 suite: {r['model']} on {r['card']} ({r['device']}, {r['dtype']}, "
        f"torch {r['torch']})", "",
        f"Read bandwidth (torch bf16 matrix-vector product {bw.get('shape')}, same run): "
        f"{_f(bw.get('gb_s'))} GB/s. Prefill chunk: "
        f"{r['sizes']['chunk_tokens'] or 'the prefill default'} tokens.", "",
        _method(r["sizes"]),
        "", f"| figure | native ({r['dtype']}) | NVFP4 | NVFP4 / native |", "|---|---|---|---|",
    ]

    def row(name: str, a, b, spec: str = ",.1f", ratio: bool = True) -> None:
        lines.append(f"| {name} | {_f(a, spec)} | {_f(b, spec)} | "
                     f"{_ratio(b, a) if ratio else ''} |")

    lim = r.get("limits", {})
    row("weight bytes read per token (GB)",
        *(_scaled(_get(lim, f, "read_bytes_per_token"), 1e-9) for f in ("native", "nvfp4")),
        ",.2f")
    limit = {f: _get(lim, f, "limit_tok_s") for f in ("native", "nvfp4")}
    row("weight-read limit, batch 1 (tok/s)", limit["native"], limit["nvfp4"])
    mesh = r.get("mesh", {})
    for b in r["sizes"]["batches"]:
        got = {f: _get(mesh, f, "decode", str(b), "decode_tok_s") for f in ("native", "nvfp4")}
        row(f"mesh decode, batch {b} (tok/s)", got["native"], got["nvfp4"])
        pct = {f: (None if not got[f] or not limit[f] else 100 * got[f] / (b * limit[f]))
               for f in got}
        row(f"mesh batch {b}, % of {b} x the weight-read limit", pct["native"], pct["nvfp4"],
            ".1f", ratio=False)
    for n in r["sizes"]["ttft_lens"]:
        got = {f: _get(mesh, f, "ttft_s", str(n)) for f in ("native", "nvfp4")}
        row(f"mesh TTFT, {n}-token prompt (ms)", *(_scaled(got[f], 1e3) for f in got))
    eng = r.get("engine", {})
    for i, b in enumerate(r["sizes"]["sweep"]):
        got = [_get(eng, f, "sweep", i, "tok_s") if _sweep_ok(eng, f, i, b) else None
               for f in ("native", "nvfp4")]
        row(f"engine decode, batch {b} (tok/s)", *got)
    gve = _get(eng, "nvfp4", "graph_vs_eager")
    if gve:
        lines += ["", f"Greedy tokens, NVFP4 weights, CUDA graphs vs eager "
                  f"({'graphs' if gve['graphs'] else 'no graphs on this device'}): "
                  f"{'equal' if gve['equal'] else 'DIFFER'} over {gve['tokens']} tokens "
                  f"(first {gve['agree_len']} agree)."]
    kv = r.get("kv", {})
    native_kv = _get(mesh, "native", "kv_transfer") or {}
    nvfp4_kv = _get(kv, "kv-nvfp4", "kv_transfer") or {}
    n = r["sizes"]["kv_prompt_tokens"]
    lines += ["", f"KV of one {n}-token prompt, native weights (the transfer tail: after the "
              "last chunk computed, staging and the writes still in flight)", "",
              "| figure | native KV | NVFP4 KV | NVFP4 / native |", "|---|---|---|---|"]
    for name, key, scale, spec in (("bytes moved (MB)", "bytes_per_room", 1e-6, ",.2f"),
                                   ("transfer tail (ms)", "tail_ms", 1, ",.2f"),
                                   ("room, first chunk to KvReady (ms)", "mean_ms", 1, ",.1f"),
                                   ("last write (GB/s)", "write_gbps_mean", 1, ",.2f")):
        a, b = _scaled(native_kv.get(key), scale), _scaled(nvfp4_kv.get(key), scale)
        lines.append(f"| {name} | {_f(a, spec)} | {_f(b, spec)} | {_ratio(b, a)} |")
    a = _scaled(_get(mesh, "native", "ttft_s", str(n)), 1e3)
    b = _scaled(_get(kv, "kv-nvfp4", "ttft_s", str(n)), 1e3)
    lines.append(f"| TTFT (ms) | {_f(a)} | {_f(b)} | {_ratio(b, a)} |")
    agree = _get(kv, "kv-nvfp4", "agreement_lengths")
    if agree is not None:
        lines += ["", f"Greedy agreement, NVFP4 KV vs native KV, {len(agree)} prompts of "
                  f"{n} tokens, first {r['sizes']['agreement_tokens']} tokens: "
                  f"{agree} (min {min(agree) if agree else '-'})."]
    control = _get(mesh, "native", "control_agreement_lengths")
    if control is not None:
        lines += ["", f"Control, native KV: the same prompts each served beside a second "
                  f"request (only the batch's rounding differs): {control} "
                  f"(min {min(control) if control else '-'})."]
    if r.get("skipped"):
        lines += ["", f"Skipped for the time budget: {', '.join(r['skipped'])}."]
    if r.get("running"):
        lines += ["", f"Cut short during phase {r['running']} (the run was stopped)."]
    if r.get("errors"):
        lines += ["", f"FAILED phases: {', '.join(r['errors'])} (tracebacks in the JSON)."]
    return "\n".join(lines) + "\n"


def _method(sizes: dict) -> str:
    """How each kind of row was taken."""
    return (f"Mesh decode rows: the best of {sizes['reps']} runs; TTFT rows: the lowest of "
            f"{sizes['ttft_reps']} requests, one at a time; engine rows: the fastest of "
            f"{sizes['sweep_rounds']} runs of {sizes['sweep_steps']} overlapped steps at a "
            f"context of {sizes['sweep_context']} tokens.")


def _scaled(v, k: float):
    return None if v is None else v * k


def _sweep_ok(eng: dict, fmt: str, i: int, batch: int) -> bool:
    rows = _get(eng, fmt, "sweep")
    return bool(rows) and i < len(rows) and rows[i]["batch"] == batch
