"""KV transfer benchmark: NIXL WRITEs between two processes, against one large descriptor.

Both pools have SmolLM2-135M's KV shape (30 layers, K and V, 3 kv heads, 64 head dim,
16-token pages), page-major as libs.transfer expects. ``--device cpu`` (the default) puts
them in DRAM in float32 (737,280 bytes a page); ``--device cuda`` puts them in VRAM of one
GPU in bfloat16 (368,640 bytes a page), each registered by its own process, so the WRITE
goes VRAM to VRAM between processes. The rows:

- the reference: ``--reference-mib`` moved in ONE descriptor, the rate of a large write;
- one request's KV for each of ``--tokens`` (1k and 4k tokens on a CPU, 1k and 8k on a
  GPU), its pages contiguous on both sides (one descriptor) and scattered (one per page),
  and with ``--chunk-tokens`` also as the prefill sends it: one WRITE per chunk (the
  prefill overlaps each with the next chunk's compute; here they go back to back).

Each row is the median of ``--reps`` WRITEs after one warm-up, timed from the post to DONE
as the prefill sees them, next to ``copy_`` of the same bytes within one process.
``reference_ratio`` is a row's time over its bytes at the reference's rate: 1.0 means the
request moved as fast as one large descriptor does. ``latency`` is a one-page WRITE, the
fixed cost every write pays.

UCX reads its environment at agent creation, so set ``UCX_TLS`` and friends before running
(both processes inherit it), e.g. ``UCX_TLS=cma,self python -m pdmesh.bench.transfer`` on a
CPU; on a GPU the default transports pick ``cuda_ipc`` between the two processes.
``pdmesh bench`` runs this module too (on the CPU), once per memcpy variant.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

LAYERS, KV, HEADS, HEAD_DIM, PAGE_TOKENS = 30, 2, 3, 64, 16
PAGE_SHAPE = (LAYERS, KV, HEADS, PAGE_TOKENS, HEAD_DIM)
MB = 1 << 20
DEFAULTS = {  # device type: (dtype, request sizes in tokens, reference MiB)
    "cpu": ("float32", "1024,4096", 64),
    "cuda": ("bfloat16", "1024,8192", 1024),
}
TARGET_REFERENCE_RATIO = 1.5  # a request's KV within 1.5x of its bytes at the reference rate


def page_bytes(dtype: torch.dtype) -> int:
    return LAYERS * KV * HEADS * PAGE_TOKENS * HEAD_DIM * dtype.itemsize


def _pool(num_pages: int, device: str, dtype: torch.dtype, random: bool) -> torch.Tensor:
    shape = (num_pages, *PAGE_SHAPE)
    if random:
        pool = torch.randn(shape, dtype=dtype, device=device)
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    if pool.is_cuda:
        torch.cuda.synchronize(pool.device)  # UCX reads it outside torch's stream order
    return pool


def receiver(conn: Connection, num_pages: int, device: str, dtype: str, progress_thread: bool,
             params: dict[str, str]) -> None:
    """Decode-side process: register a zeroed pool, publish it, serve until told to exit."""
    from libs.transfer import KvAgent

    pool = _pool(num_pages, device, getattr(torch, dtype), random=False)
    agent = KvAgent("bench-decode", pool, page_bytes(pool.dtype),
                    progress_thread=progress_thread, backend_params=params)
    conn.send((agent.metadata(), agent.layout().to_dict()))
    while True:
        # Like a decode service's loop: drain notifications (which also drives UCX progress
        # when there is no progress thread) about every millisecond between commands.
        if not conn.poll(0.001):
            agent.get_notifs()
            continue
        cmd, arg = conn.recv()
        if cmd == "check":  # (dst_pages,): a sum of the landed pages, to compare
            dst, = arg
            conn.send(float(pool[dst].sum(dtype=torch.float64)))
        elif cmd == "exit":
            agent.close()
            conn.send("bye")
            return


def _spin(xfer: object) -> str:
    while (state := xfer.poll()) == "PROC":  # type: ignore[attr-defined]
        pass
    return state


def time_nixl(agent, peer: str, layout, src: list[int], dst: list[int], reps: int,
              per_write: int = 0) -> dict:
    """Median seconds from the first post to the last DONE, and of the posts alone, after
    one warm-up. ``per_write`` pages a WRITE, all posted back to back (0: one WRITE)."""
    step = per_write or len(src)
    times, posts, descs = [], [], 0
    for i in range(reps + 1):
        t0 = time.perf_counter()
        xfers = [agent.write_pages(peer, layout, src[j : j + step], dst[j : j + step])
                 for j in range(0, len(src), step)]
        t1 = time.perf_counter()
        states = [_spin(x) for x in xfers]
        elapsed = time.perf_counter() - t0
        descs = sum(x.descriptors for x in xfers)
        for x in xfers:
            x.release()
        if set(states) != {"DONE"}:
            raise RuntimeError(f"transfer ended {states}: {[x.error for x in xfers]}")
        if i:
            times.append(elapsed)
            posts.append(t1 - t0)
    return {"nixl_s": statistics.median(times), "post_s": statistics.median(posts),
            "descriptors": descs, "writes": -(-len(src) // step)}


def time_copy(pool: torch.Tensor, n: int, reps: int) -> float:
    """Seconds per ``copy_`` of ``n`` pages within one process (median after warm-up)."""
    src, dst = pool[:n], pool[n : 2 * n]
    times = []
    for i in range(reps + 1):
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        elapsed = time.perf_counter() - t0
        if i:
            times.append(elapsed)
    return statistics.median(times)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdmesh.bench.transfer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu",
                        help="cpu (DRAM, the default) or cuda[:N] (VRAM of one GPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="KV dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--tokens", metavar="N,N,...",
                        help="request sizes in tokens (default: 1024,4096 on cpu, "
                        "1024,8192 on cuda)")
    parser.add_argument("--reference-mib", type=int,
                        help="bytes of the one-descriptor reference WRITE, in MiB "
                        "(default: 64 on cpu, 1024 on cuda)")
    parser.add_argument("--chunk-tokens", type=int, default=0,
                        help="also move each request as one WRITE per chunk of this many "
                        "tokens, posted back to back, as the prefill writes it (default: off)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench-results/transfer.json")
    parser.add_argument("--progress-thread", action="store_true",
                        help="enable NIXL's progress thread (busy-polls one core)")
    parser.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                        help="UCX backend init param, e.g. ucx_error_handling_mode=none")
    args = parser.parse_args(argv)
    kind = torch.device(args.device).type
    if kind not in DEFAULTS:
        parser.error(f"--device {args.device}: cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    dtype, tokens, reference = DEFAULTS[kind]
    args.dtype = args.dtype or dtype
    args.tokens = [int(t) for t in (args.tokens or tokens).split(",")]
    args.reference_mib = args.reference_mib or reference
    if min(args.tokens) <= 0 or args.reference_mib <= 0 or args.reps <= 0:
        parser.error("--tokens, --reference-mib and --reps must be positive")
    if args.chunk_tokens < 0 or args.chunk_tokens % PAGE_TOKENS:
        parser.error(f"--chunk-tokens must be a multiple of the page size ({PAGE_TOKENS})")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from libs.transfer import KvAgent, PoolLayout

    dtype = getattr(torch, args.dtype)
    size = page_bytes(dtype)
    reference_pages = -(-args.reference_mib * MB // size)
    requests = {f"{t // 1024}k-token prompt" if t % 1024 == 0 else f"{t}-token prompt":
                -(-t // PAGE_TOKENS) for t in args.tokens}
    num_pages = 2 * max(reference_pages, *requests.values())  # room for scattered and copy_
    progress = args.progress_thread
    params = dict(kv.split("=", 1) for kv in args.ucx_param)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=receiver,
                       args=(child, num_pages, args.device, args.dtype, progress, params))
    proc.start()
    metadata, layout_dict = conn.recv()
    layout = PoolLayout.from_dict(layout_dict)
    pool = _pool(num_pages, args.device, dtype, random=True)
    agent = KvAgent("bench-prefill", pool, size, progress_thread=progress, backend_params=params)
    peer = agent.add_peer(metadata)

    def row(case: str, pattern: str, tokens: int | None, src: list[int], dst: list[int],
            per_write: int = 0) -> dict:
        timed = time_nixl(agent, peer, layout, src, dst, args.reps, per_write)
        conn.send(("check", (dst,)))
        landed = conn.recv()
        expected = float(pool[src].sum(dtype=torch.float64))
        assert abs(landed - expected) <= 1e-6 * max(1.0, abs(expected)), "bytes differ"
        n = len(src)
        copy_s = time_copy(pool, n, args.reps)
        nbytes = n * size
        return {"case": case, "pattern": pattern, "tokens": tokens, "pages": n, "bytes": nbytes,
                **timed, "memcpy_s": copy_s, "nixl_gbps": nbytes / timed["nixl_s"] / 1e9,
                "memcpy_gbps": nbytes / copy_s / 1e9, "ratio": copy_s / timed["nixl_s"]}

    try:
        latency = time_nixl(agent, peer, layout, [0], [0], args.reps)
        first = list(range(reference_pages))
        reference = row(f"{args.reference_mib} MB", "contiguous", None, first, first)
        rows = [reference]
        for label, n in requests.items():
            patterns = {
                "contiguous": (list(range(n)), list(range(n))),
                "scattered": (list(range(n)), list(range(0, 2 * n, 2))),
            }
            for pattern, (src, dst) in patterns.items():
                rows.append(row(label, pattern, n * PAGE_TOKENS, src, dst))
            if args.chunk_tokens:
                rows.append(row(label, f"chunks of {args.chunk_tokens}", n * PAGE_TOKENS,
                                list(range(n)), list(range(n)), args.chunk_tokens // PAGE_TOKENS))
    finally:  # a child that died or hangs must not hang the bench: bounded, then killed
        try:
            conn.send(("exit", None))
            if conn.poll(10):
                conn.recv()
        except (EOFError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        agent.close()

    rate = reference["bytes"] / reference["nixl_s"]  # bytes per second of one descriptor
    for r in rows:
        r["reference_ratio"] = r["nixl_s"] / (r["bytes"] / rate)
    device_name = (torch.cuda.get_device_name(pool.device) if pool.is_cuda
                   else platform.processor() or platform.machine())
    print(f"{args.device} ({device_name}), {args.dtype}, {size:,} bytes a page; one-page WRITE "
          f"{latency['nixl_s'] * 1e6:.1f} us; reference {rate / 1e9:.1f} GB/s in 1 descriptor")
    print(f"{'case':<16} {'pattern':<15} {'bytes':>11} {'descs':>5} {'time us':>9} "
          f"{'NIXL GB/s':>9} {'copy GB/s':>9} {'vs copy':>7} {'vs 1 desc':>9}")
    for r in rows:
        met = "ok" if r["reference_ratio"] <= TARGET_REFERENCE_RATIO else "over"
        print(f"{r['case']:<16} {r['pattern']:<15} {r['bytes']:>11} {r['descriptors']:>5} "
              f"{r['nixl_s'] * 1e6:>9.1f} {r['nixl_gbps']:>9.2f} {r['memcpy_gbps']:>9.2f} "
              f"{r['ratio']:>7.2f} {r['reference_ratio']:>6.2f} {met}")
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    result = {
        "device": args.device, "device_name": device_name, "dtype": args.dtype,
        "page_bytes": size, "page_tokens": PAGE_TOKENS, "reps": args.reps,
        "progress_thread": progress, "ucx_params": params,
        "torch_threads": torch.get_num_threads(), "ucx_env": env,
        "latency": {"bytes": size, **latency},
        "reference": {"bytes": reference["bytes"], "descriptors": reference["descriptors"],
                      "nixl_s": reference["nixl_s"], "nixl_gbps": rate / 1e9},
        "target_reference_ratio": TARGET_REFERENCE_RATIO,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}  (UCX env: {env or 'defaults'})")
    return result


if __name__ == "__main__":
    main()
