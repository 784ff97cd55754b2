"""`pdmesh bench`'s table, its time breakdown and its plot."""

from __future__ import annotations

import os
from pathlib import Path

SIDES = ("transformers", "engine", "mesh")


def one_line(f: dict) -> str:
    """A run's headline figures, for the log."""
    def ms(x):
        return "-" if x is None else f"{1e3 * x:.0f}"

    rate = "-" if f["output_tok_s"] is None else f"{f['output_tok_s']:,.1f}"
    errors = f", {sum(f['errors'].values())} errors {f['errors']}" if f["errors"] else ""
    kv = f.get("kv_transfer") or {}
    moved = (f", KV {kv['bytes'] / 1e6:.1f} MB in {kv['rooms']} rooms, "
             f"{kv['mean_ms']:.1f} ms each" if kv.get("rooms") else "")
    return (f"{f['completed']}/{f['requests']} requests, {rate} tok/s, TTFT p50 "
            f"{ms(f['ttft_s']['p50'])} p99 {ms(f['ttft_s']['p99'])} ms, ITL p50 "
            f"{ms(f['itl_s']['p50'])} ms, E2E p50 {ms(f['e2e_s']['p50'])} ms{moved}{errors}")


def _multi_label(args, loads) -> str:
    multi = loads["multi"]
    if multi.rate:
        return f"{len(multi.requests)} req @{multi.rate:g}/s"
    if multi.concurrency >= len(multi.requests):
        return f"{len(multi.requests)}-stream"
    return f"{len(multi.requests)} req x{multi.concurrency}"


def summary_rows(args, loads, sides: dict[str, dict]) -> list[dict]:
    """One row per headline figure: each side's best, and the mesh's ratio to the others
    (> 1 means the mesh wins). Targets are the CPU goals against transformers."""
    m = _multi_label(args, loads)
    specs = [
        # metric, scenario, figure, quantile, scale, lower is better, target vs transformers
        ("single-stream decode tok/s", "single", "stream_decode_tok_s", "p50", 1, False, 1.0),
        ("single-stream end-to-end tok/s", "single", "output_tok_s", None, 1, False, None),
        (f"{m} aggregate tok/s", "multi", "output_tok_s", None, 1, False, 1.5),
        (f"{m} decode-phase tok/s", "multi", "decode_tok_s", None, 1, False, None),
        (f"{m} TTFT p50 ms", "multi", "ttft_s", "p50", 1e3, True, None),
        (f"{m} TTFT p99 ms", "multi", "ttft_s", "p99", 1e3, True, None),
        (f"{m} ITL p50 ms", "multi", "itl_s", "p50", 1e3, True, None),
        (f"{m} ITL p99 ms", "multi", "itl_s", "p99", 1e3, True, None),
        (f"{m} E2E p50 ms", "multi", "e2e_s", "p50", 1e3, True, None),
        (f"{m} E2E p99 ms", "multi", "e2e_s", "p99", 1e3, True, None),
        (f"TTFT {len(loads['ttft'].requests[0].prompt_ids)}-token prompt ms", "ttft", "ttft_s",
         "p50", 1e3, True, None),
    ]
    rows = []
    for metric, scenario, figure, q, scale, lower, target in specs:
        row: dict = {"metric": metric, "lower_is_better": lower}
        for side in SIDES:
            value = None
            if side in sides:
                value = sides[side]["best"][scenario][figure]
                value = value[q] if q else value
            row[side] = None if value is None else value * scale
        for other in ("transformers", "engine"):
            a, b = row["mesh"], row[other]
            row[f"mesh_vs_{other}"] = (b / a if lower else a / b) if a and b else None
        ratio = row["mesh_vs_transformers"]
        row["target"] = target
        row["met"] = None if target is None or ratio is None else ratio >= target
        rows.append(row)
    return rows


def _fmt(v, spec: str = ",.1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict], sides: dict[str, dict], transfer: dict | None) -> None:
    print()
    print(f"{'metric':<34} {'transformers':>12} {'engine':>10} {'mesh':>10} "
          f"{'mesh/hf':>7} {'mesh/eng':>8} {'target':>7} met?")
    for r in rows:
        target = "-" if r["target"] is None else f">={r['target']:.2f}x"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['metric']:<34} {_fmt(r['transformers']):>12} {_fmt(r['engine']):>10} "
              f"{_fmt(r['mesh']):>10} {_fmt(r['mesh_vs_transformers'], '.2f'):>7} "
              f"{_fmt(r['mesh_vs_engine'], '.2f'):>8} {target:>7} {met}")
    print("(mesh/hf, mesh/eng: the mesh's figure over the other's, inverted for times: "
          "> 1 means the mesh wins; targets are against transformers)")
    mesh = sides.get("mesh")
    if mesh:
        for scenario in ("multi", "ttft"):
            kv = mesh["runs"][scenario][-1].get("kv_transfer") or {}
            if kv.get("rooms"):
                gbps = kv.get("write_gbps_mean")
                last = "" if gbps is None else (f"; {kv['descriptors'] / kv['rooms']:.1f} "
                                                f"descriptors, last write {gbps:.1f} GB/s")
                print(f"mesh KV transfer, {scenario}: {kv['rooms']} rooms, "
                      f"{kv['bytes_per_room'] / 1e6:.2f} MB and {kv['mean_ms']:.2f} ms a room "
                      f"(first chunk written to KvReady, prefill overlapped){last}")
    errors = {side: s["best"][sc]["errors"] for side, s in sides.items() for sc in s["best"]
              if s["best"][sc]["errors"]}
    if errors:
        print(f"REQUESTS FAILED: {errors} (see the JSON's errors by code)")
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


def print_breakdown(args, sides: dict[str, dict]) -> None:
    """Where the time goes: the engine's step times and each mesh process's CPU seconds."""
    engine, mesh = sides.get("engine"), sides.get("mesh")
    if not (engine or mesh):
        return
    print("time breakdown")
    if engine:
        b = engine["breakdown"]
        steps = ", ".join(f"b={k.removeprefix('decode_step_b').removesuffix('_ms')} {v:.2f} ms"
                          for k, v in b.items() if k.startswith("decode_step_b"))
        print(f"  engine alone: decode step {steps}; prefill {b['prefill_long_tokens']} tokens "
              f"in {b['chunk_tokens']}-token chunks {b['prefill_long_chunked_ms']:.1f} ms, one "
              f"chat prompt {b['prefill_one_chat_ms']:.1f} ms")
    if mesh:
        for scenario in ("single", "multi", "ttft"):
            r = mesh["runs"][scenario][-1]
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in r.get("cpu_s", {}).items() if v >= 0.05)
            print(f"  mesh CPU s during {scenario} (wall {r.get('wall_s', 0):.1f} s, "
                  f"{os.cpu_count()} cores): {cpu}")
            steps = r.get("decode_steps") or {}
            if steps.get("steps"):
                parts = ", ".join(f"{k} {v:.2f}" for k, v in steps["ms"].items())
                print(f"  mesh decode steps during {scenario}: {steps['steps']}, "
                      f"{sum(steps['ms'].values()):.2f} ms each: {parts}")
    print()


def plot(result: dict, path: Path) -> bool:
    """The table as a PNG: throughput, and TTFT / ITL / E2E percentiles of the multi
    scenario, per side. False (and a line saying why) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install matplotlib)")
        return False
    sides = [s for s in SIDES if s in result["sides"]]
    if not sides:
        return False
    best = {s: result["sides"][s]["best"] for s in sides}
    settings = result["settings"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / len(sides)

    def bars(ax, groups: list[tuple[str, str, str, str | None]], scale: float, unit: str):
        for i, side in enumerate(sides):
            values = []
            for _, scenario, figure, q in groups:
                v = best[side][scenario][figure]
                v = v[q] if q else v
                values.append(0.0 if v is None else v * scale)
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=side)
        ax.set_xticks([g + width * (len(sides) - 1) / 2 for g in range(len(groups))],
                      [label for label, *_ in groups])
        ax.set_ylabel(unit)
        ax.legend(fontsize="small")

    bars(axes[0][0], [("1 stream decode", "single", "stream_decode_tok_s", "p50"),
                      ("multi aggregate", "multi", "output_tok_s", None)], 1, "tokens/s")
    axes[0][0].set_title("throughput")
    for ax, figure, title, scale, unit in (
        (axes[0][1], "ttft_s", "time to first token (multi)", 1e3, "ms"),
        (axes[1][0], "itl_s", "inter-token latency (multi)", 1e3, "ms"),
        (axes[1][1], "e2e_s", "end-to-end latency (multi)", 1e3, "ms"),
    ):
        bars(ax, [(q, "multi", figure, q) for q in ("p50", "p90", "p99")], scale, unit)
        ax.set_title(title)
    fig.suptitle(f"pdmesh bench: {settings['model']} {settings['dtype']} on "
                 f"{settings.get('gpu') or settings['device']}, "
                 f"{result['workloads']['multi']['requests']} requests "
                 f"({result['workloads']['multi']['arrivals']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
