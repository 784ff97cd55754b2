"""KV transfer benchmark: NIXL WRITE between two processes vs an in-process memcpy.

The pool has SmolLM2-135M's KV shape (30 layers, K and V, 3 kv heads, 64 head dim, 16-token
pages, fp32: 737,280 bytes per page), page-major as libs.transfer expects. Each case moves
the pages of one prompt once as contiguous runs (1 descriptor) and once scattered (one
descriptor per page), timing N repetitions, and times ``copy_`` of the same byte count in
the same run. The target is NIXL >= 70% of memcpy.

UCX reads its environment at agent creation, so set ``UCX_TLS`` and friends before running
(both processes inherit it), e.g. ``UCX_TLS=cma,self python -m pdmesh.bench.transfer``.
``pdmesh bench`` runs this module too, once per memcpy variant.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

LAYERS, KV, HEADS, HEAD_DIM, PAGE_TOKENS = 30, 2, 3, 64, 16
PAGE_SHAPE = (LAYERS, KV, HEADS, PAGE_TOKENS, HEAD_DIM)
PAGE_BYTES = LAYERS * KV * HEADS * PAGE_TOKENS * HEAD_DIM * 4
MB = 1 << 20


def _pool(num_pages: int, fill: float | None) -> torch.Tensor:
    if fill is None:
        return torch.randn((num_pages, *PAGE_SHAPE), dtype=torch.float32)
    return torch.full((num_pages, *PAGE_SHAPE), fill, dtype=torch.float32)


def receiver(
    conn: Connection, num_pages: int, progress_thread: bool, params: dict[str, str]
) -> None:
    """Decode-side process: register a zeroed pool, publish it, serve until told to exit."""
    from libs.transfer import KvAgent

    pool = _pool(num_pages, 0.0)
    agent = KvAgent(
        "bench-decode", pool, PAGE_BYTES, progress_thread=progress_thread, backend_params=params
    )
    conn.send((agent.metadata(), agent.layout().to_dict()))
    while True:
        # Like a decode service's loop: drain notifications (which also drives UCX progress
        # when there is no progress thread) about every millisecond between commands.
        if not conn.poll(0.001):
            agent.get_notifs()
            continue
        cmd, arg = conn.recv()
        if cmd == "check":  # (dst_pages, expected sum) spot check of the landed bytes
            dst, = arg
            conn.send(float(pool[dst].double().sum()))
        elif cmd == "exit":
            agent.close()
            conn.send("bye")
            return


def _spin(xfer: object) -> str:
    while (state := xfer.poll()) == "PROC":  # type: ignore[attr-defined]
        pass
    return state


def time_nixl(agent, peer: str, layout, src: list[int], dst: list[int], reps: int) -> tuple:
    """Seconds per WRITE (median of ``reps`` after one warm-up) and the descriptor count."""
    times, descs = [], 0
    for i in range(reps + 1):
        t0 = time.perf_counter()
        xfer = agent.write_pages(peer, layout, src, dst)
        state = _spin(xfer)
        elapsed = time.perf_counter() - t0
        descs = xfer.descriptors
        xfer.release()
        if state != "DONE":
            raise RuntimeError(f"transfer ended {state}")
        if i:
            times.append(elapsed)
    return statistics.median(times), descs


def time_memcpy(pool: torch.Tensor, n: int, reps: int) -> float:
    """Seconds per ``copy_`` of ``n`` pages within one process (median after warm-up)."""
    src, dst = pool[:n], pool[n : 2 * n]
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        elapsed = time.perf_counter() - t0
        if i:
            times.append(elapsed)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.bench.transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench-results/transfer.json")
    parser.add_argument("--progress-thread", action="store_true",
                        help="enable NIXL's progress thread (busy-polls one core)")
    parser.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                        help="UCX backend init param, e.g. ucx_error_handling_mode=none")
    args = parser.parse_args(argv)
    from libs.transfer import KvAgent, PoolLayout

    cases = {"1k-token prompt": 64, "4k-token prompt": 256, "64 MB": -(-64 * MB // PAGE_BYTES)}
    max_pages = 2 * max(cases.values())
    progress = args.progress_thread
    params = dict(kv.split("=", 1) for kv in args.ucx_param)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, max_pages, progress, params))
    proc.start()
    metadata, layout_dict = conn.recv()
    layout = PoolLayout.from_dict(layout_dict)
    pool = _pool(max_pages, None)
    agent = KvAgent(
        "bench-prefill", pool, PAGE_BYTES, progress_thread=progress, backend_params=params
    )
    peer = agent.add_peer(metadata)

    rows = []
    try:
        for label, n in cases.items():
            memcpy_s = time_memcpy(pool, n, args.reps)
            patterns = {
                "contiguous": (list(range(n)), list(range(n))),
                "scattered": (list(range(n)), list(range(0, 2 * n, 2))),
            }
            for pattern, (src, dst) in patterns.items():
                nixl_s, descs = time_nixl(agent, peer, layout, src, dst, args.reps)
                conn.send(("check", (dst,)))
                landed = conn.recv()
                expected = float(pool[src].double().sum())
                assert abs(landed - expected) <= 1e-6 * max(1.0, abs(expected)), "bytes differ"
                size = n * PAGE_BYTES
                rows.append({
                    "case": label, "pattern": pattern, "pages": n, "bytes": size,
                    "descriptors": descs, "nixl_s": nixl_s, "memcpy_s": memcpy_s,
                    "nixl_gbps": size / nixl_s / 1e9, "memcpy_gbps": size / memcpy_s / 1e9,
                    "ratio": memcpy_s / nixl_s,
                })
    finally:
        conn.send(("exit", None))
        conn.recv()
        proc.join(10)
        agent.close()

    print(f"{'case':<16} {'pattern':<11} {'bytes':>11} {'descs':>5} "
          f"{'NIXL GB/s':>9} {'memcpy GB/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<16} {r['pattern']:<11} {r['bytes']:>11} {r['descriptors']:>5} "
              f"{r['nixl_gbps']:>9.2f} {r['memcpy_gbps']:>11.2f} {r['ratio']:>6.2f}")
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    result = {
        "page_bytes": PAGE_BYTES, "reps": args.reps, "progress_thread": progress,
        "ucx_params": params,
        "torch_threads": torch.get_num_threads(), "ucx_env": env, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}  (UCX env: {env or 'defaults'})")


if __name__ == "__main__":
    main()
