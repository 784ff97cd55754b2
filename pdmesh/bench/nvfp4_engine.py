"""The in-process parts of `pdmesh bench --suite nvfp4`: the weight-read limit, the engine's
decode batch sweep, and graph-vs-eager greedy equality.

The weight-read limit of a decode step at batch 1 is the bytes every step must read (each
layer's linears, the final norm and lm_head; the embedding is a one-row gather, except
tied, where it is lm_head too) divided by the device's read bandwidth. The bandwidth is
measured here, in the same run as the figures it bounds: one large bf16 matrix-vector
product through torch (F.linear of one token), bytes of the matrix over its best time.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn.functional as F

from libs.engine.config import ModelConfig
from libs.engine.engine import DecodeSeq, Engine
from libs.engine.host_tokens import HostTokens
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from libs.engine.sampling import greedy_tokens
from libs.engine.weight_budget import linear_weights, nvfp4_bytes

PAGE_SIZE = 16
# The matrix of the read-bandwidth measurement: Llama-3-70B's down projection on a GPU
# (470 MB, far past any cache), a smaller one on the CPU.
BANDWIDTH_SHAPE = {"cuda": (8192, 28672), "cpu": (1024, 4096)}


def read_bytes_per_token(config: ModelConfig, weights_format: str, dtype_bytes: int = 2) -> int:
    """Bytes a decode step reads at batch 1 (see the module doc); lm_head stays dense."""
    c = config
    linears = c.n_layers * linear_weights(c)
    layers = linears * dtype_bytes if weights_format == "native" else nvfp4_bytes(linears)
    norms = (2 * c.n_layers + 1) * c.dim * dtype_bytes
    return layers + norms + c.vocab_size * c.dim * dtype_bytes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, reps: int = 10, calls: int = 10) -> dict:
    """Bytes/s of one large bf16 matrix-vector product (F.linear, one token): the best of
    `reps` timings of `calls` products back to back (one sync per timing, so its cost
    does not count against the bandwidth; the matrix is far larger than any cache)."""
    n, k = BANDWIDTH_SHAPE["cuda" if device.type == "cuda" else "cpu"]
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            F.linear(x, w)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    nbytes = w.numel() * w.element_size()
    del w, x
    _release(device)
    return {"shape": [n, k], "bytes": nbytes, "best_s": best, "gb_s": nbytes / best / 1e9}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def engine_phase(model: str, device: torch.device, dtype: torch.dtype, weights_format: str,
                 batches: list[int], context: int, steps: int, graph_check_tokens: int,
                 rounds: int = 1) -> dict:
    """Load the model in `weights_format`, sweep decode batches, and (on CUDA) compare the
    graphs' greedy tokens with the eager path's. Frees everything before returning."""
    t0 = time.perf_counter()
    loaded = load_model(model, device, dtype, weights_format)
    sync(device)
    out: dict = {"load_s": time.perf_counter() - t0}
    max_batch = max(batches)
    pages_each = -(-(context + steps + 8) // PAGE_SIZE)
    prompt_pages = -(-(32 + graph_check_tokens + 1) // PAGE_SIZE)
    pool = KvPool(loaded.config, max_batch * pages_each + 2 * prompt_pages, PAGE_SIZE,
                  device=device, dtype=dtype)
    graphs = device.type == "cuda"
    engine = Engine(loaded.config, loaded.weights, pool, max_batch=max_batch,
                    max_context=context + steps + 8, cuda_graphs=None if graphs else False)
    t0 = time.perf_counter()
    engine.capture_decode_graphs(max_batch)
    sync(device)
    out["graph_capture_s"] = time.perf_counter() - t0 if graphs else None
    out["sweep"] = sweep(engine, pool, batches, context, steps, rounds)
    out["graph_vs_eager"] = graph_vs_eager(loaded, engine, pool, graph_check_tokens)
    del engine, pool, loaded
    _release(device)
    return out


def decode_overlapped(engine: Engine, pages: list[list[int]], first: list[int], start: int,
                      steps: int, tokens: HostTokens) -> list[list[int]]:
    """`steps` greedy decode steps of one sequence a page list, from position `start`, the
    first step's tokens `first`, overlapped as the decode service's steps are on CUDA
    (services/decode/batcher.py): step N + 1 is launched feeding step N's ids from the
    device, then the host waits for step N's ids alone, so the host's share of a step
    (packing the rows, the launch) overlaps the device's. Each step's ids, in order."""
    out: list[list[int]] = []
    fed: torch.Tensor | None = None
    pending = None
    for i in range(steps):
        seqs = [DecodeSeq(p, start + i, first[j] if fed is None else -1 - j)
                for j, p in enumerate(pages)]
        fed = greedy_tokens(engine.decode_step(seqs, copy=False, fed=fed))
        launched = tokens.start(fed)
        if pending is not None:
            out.append(pending.wait())
        pending = launched
    if pending is not None:
        out.append(pending.wait())
    return out


def sweep(engine: Engine, pool: KvPool, batches: list[int], context: int,
          steps: int, rounds: int = 1) -> list[dict]:
    """Decode tokens/s at each batch size: the fastest of `rounds` runs of `steps` steps
    (decode_overlapped: a step costs the longer of the host's share and the device's, as
    in the service) at a context of `context` tokens (the KV there is whatever the pool
    holds: timing only). A run ends when its last step's ids are on the host. The fastest
    run is the one a host stall touched least (a stall only adds time)."""
    rows = []
    tokens = HostTokens()
    for b in batches:
        pages = [pool.alloc(pool.pages_for(context + steps + 1)) for _ in range(b)]

        def run(n: int, pages=pages) -> float:
            sync(engine.device)
            t0 = time.perf_counter()
            decode_overlapped(engine, pages, [5] * len(pages), context, n, tokens)
            return time.perf_counter() - t0

        run(2)  # warm-up: the bucket's first replay
        elapsed = min(run(steps) for _ in range(rounds))
        rows.append({"batch": b, "step_ms": 1e3 * elapsed / steps,
                     "tok_s": b * steps / elapsed})
        for p in pages:
            pool.free(p)
    return rows


def greedy(engine: Engine, pool: KvPool, prompt: list[int], tokens: int) -> list[int]:
    pages = pool.alloc(pool.pages_for(len(prompt) + tokens + 1))
    try:
        out = [int(engine.prefill(prompt, pages).argmax())]
        for i in range(tokens - 1):
            seq = DecodeSeq(pages, len(prompt) + i, out[-1])
            out.append(int(engine.decode_step([seq]).argmax(-1)[0]))
        return out
    finally:
        pool.free(pages)


def graph_vs_eager(loaded, engine: Engine, pool: KvPool, tokens: int) -> dict:
    """Greedy tokens of one prompt through `engine` (graphs on CUDA) and through an
    engine on the same weights and pool launching the same forward eagerly."""
    prompt = [(7 * i + 3) % min(loaded.config.vocab_size, 32000) + 10 for i in range(32)]
    # batch 1 runs in bucket 1 on both: the same padded shapes, so the same bits
    eager = Engine(loaded.config, loaded.weights, pool, max_batch=1,
                   max_context=engine.max_context, cuda_graphs=False)
    a = greedy(engine, pool, prompt, tokens)
    b = greedy(eager, pool, prompt, tokens)
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {"graphs": engine.graphs is not None, "tokens": tokens, "equal": a == b,
            "agree_len": same}
