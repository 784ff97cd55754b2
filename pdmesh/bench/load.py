"""`pdmesh bench --workload chat`: what a user sees of a mesh under load.

A concurrency sweep of chat requests against a running router (``--router``: gRPC
``host:port``, or ``http://host:port`` for the OpenAI API), or against a mesh it starts.
Each level sends ``--requests`` requests closed loop at that concurrency: prompts of
``--prompt-words`` words and ``max_tokens`` drawn from ``--max-tokens`` (seeded, the same
requests at every level). Per level it reports:

* completed, and refused: answered 429 or 503 (gRPC RESOURCE_EXHAUSTED or UNAVAILABLE),
  as a fraction of the requests; other errors by code;
* goodput: requests that completed with TTFT <= ``--ttft-slo`` and a mean inter-token
  gap <= ``--itl-slo`` (per request, first token to last), as a fraction and per second;
* TTFT and inter-token latency p50/p90/p99 (pdmesh/bench/workload.py's figures);
* queue time: the router's ``pdmesh_queue_time_seconds`` over the level (requests
  counted, mean wait, how many waited longer than 5 ms);
* preemptions: the members' ``pdmesh_preemptions_total`` over the level, or "not
  exposed" when no member has that metric;
* quiescence after the level (with ``--bootstrap``): seconds until every member reports
  inflight 0 and no KV page held, pinned rooms, pages still held after 5 s.

Prints a table, writes the JSON to ``--out``.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

import anyio

from pdmesh.bench.progress import Progress
from pdmesh.bench.prompts import words
from pdmesh.bench.workload import Lengths, Record, Request, percentiles, summarize

REFUSED_HTTP = {"429", "503"}
REFUSED_GRPC = {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}
QUIET_WITHIN = 1.0  # seconds: the storms' quiescence check
LEAK_AFTER = 5.0  # seconds: pages still held after this are a leak


def concurrency_list(text: str) -> list[int]:
    """`--concurrency 8,16,48`: one or more positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not N or N,N,...") from None
    if not values or min(values) < 1:
        raise ValueError(f"{text!r}: each concurrency must be at least 1")
    return values


def chat_requests(count: int, prompt_words: Lengths, max_tokens: Lengths,
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = prompt_words.draw(rng)
        text = f"{words(n, salt=i)}\nSummarise the notes above."
        out.append(Request(i, [], max_tokens.draw(rng),
                           messages=[{"role": "user", "content": text}]))
    return out


def goodput(records: list[Record], ttft_slo: float, itl_slo: float) -> list[bool]:
    """Per request: completed within both SLOs (one-token answers need only the TTFT)."""
    met = []
    for r in records:
        if r.error is not None or not r.pieces:
            met.append(False)
            continue
        ttft = r.pieces[0][0] - r.sent
        after = r.tokens - r.pieces[0][1]
        itl = (r.pieces[-1][0] - r.pieces[0][0]) / after if after else 0.0
        met.append(ttft <= ttft_slo and itl <= itl_slo)
    return met


def level_figures(records: list[Record], wall: float, http: bool, ttft_slo: float,
                  itl_slo: float, queue: dict, preemptions: float | None) -> dict:
    figures = summarize(records)
    refused_codes = REFUSED_HTTP if http else REFUSED_GRPC
    refused = sum(1 for r in records if r.error in refused_codes)
    met = goodput(records, ttft_slo, itl_slo)
    n = len(records)
    figures.update(
        wall_s=wall,
        refused=refused, refused_fraction=refused / n if n else None,
        goodput=sum(met), goodput_fraction=sum(met) / n if n else None,
        goodput_req_s=sum(met) / wall if wall > 0 else None,
        queue=queue,
        preemptions=preemptions,  # None: no member exposes pdmesh_preemptions_total
    )
    return figures


# ---- the mesh's own figures ------------------------------------------------------------

def _samples(url: str) -> dict[str, float]:
    """name{labels} -> value of a Prometheus text page (names and labels kept whole)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if "le" not in s.labels else f"{{le={s.labels['le']}}}")
            out[key] = out.get(key, 0.0) + s.value
    return out


class MeshFigures:
    """Counters read from the members' /metrics before and after a level."""

    def __init__(self, bootstrap: str | None) -> None:
        self.bootstrap = bootstrap

    def members(self) -> list[dict]:
        if self.bootstrap is None:
            return []
        from pdmesh.status import collect

        return anyio.run(collect, self.bootstrap)["members"]

    def read(self) -> dict[str, dict[str, float]]:
        out = {}
        for m in self.members():
            if m.get("metrics"):
                try:
                    out[m["name"]] = _samples(m["metrics"])
                except OSError:
                    continue
        return out

    @staticmethod
    def queue(before: dict, after: dict) -> dict:
        def delta(key: str) -> float:
            return sum(a.get(key, 0.0) - before.get(name, {}).get(key, 0.0)
                       for name, a in after.items())

        count = delta("pdmesh_queue_time_seconds_count")
        if not any("pdmesh_queue_time_seconds_count" in a for a in after.values()):
            return {"requests": None, "mean_s": None, "waited": None}
        waited = count - delta("pdmesh_queue_time_seconds_bucket{le=0.005}")
        return {"requests": int(count),
                "mean_s": delta("pdmesh_queue_time_seconds_sum") / count if count else None,
                "waited": int(waited)}

    @staticmethod
    def preemptions(before: dict, after: dict) -> float | None:
        key = "pdmesh_preemptions_total"
        if not any(key in a for a in after.values()):
            return None
        return sum(a.get(key, 0.0) - before.get(n, {}).get(key, 0.0) for n, a in after.items())

    def quiescence(self) -> dict | None:
        """Seconds until inflight 0 and no page held on every member (the storms' check),
        pinned rooms, and the pages still held after LEAK_AFTER."""
        if self.bootstrap is None:
            return None
        t0 = time.monotonic()
        while True:
            members = [m for m in self.members() if m["role"] in ("prefill", "decode")]
            busy = [m for m in members if m["inflight"] or m["kv_pages_used"]]
            waited = time.monotonic() - t0
            if not busy or waited > LEAK_AFTER:
                break
            time.sleep(0.02)
        return {"quiet_s": None if busy else round(waited, 3),
                "quiet_within_1s": not busy and waited <= QUIET_WITHIN,
                "pinned": sum(len(m["pinned"]) for m in members),
                "pages_held": sum(m["kv_pages_used"] or 0 for m in members)}


# ---- sending -------------------------------------------------------------------------

async def _send_grpc(address: str, requests: list[Request], concurrency: int,
                     progress: Progress) -> list[Record]:
    import grpc

    from pdmesh.client import GenerateClient, Piece

    records: list[Record | None] = [None] * len(requests)
    async with GenerateClient(address, timeout=600.0) as client:
        model = (await client.models())[0]
        start = time.perf_counter()

        async def one(r: Request) -> None:
            record = Record(time.perf_counter() - start)
            try:
                async for event in client.generate(model=model, max_tokens=r.output_tokens,
                                                   messages=r.messages):
                    if isinstance(event, Piece) and event.token_ids:
                        record.pieces.append((time.perf_counter() - start,
                                              len(event.token_ids)))
                        progress.add(tokens=len(event.token_ids))
            except grpc.aio.AioRpcError as e:
                record.error = e.code().name
            records[r.index] = record
            progress.add(done=1)

        await _closed_loop(requests, concurrency, one)
    return records


async def _send_http(base: str, requests: list[Request], concurrency: int,
                     progress: Progress) -> list[Record]:
    import httpx

    records: list[Record | None] = [None] * len(requests)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base.rstrip("/") + "/v1", timeout=600.0,
                                 limits=limits) as http:
        model = (await http.get("/models")).json()["data"][0]["id"]
        start = time.perf_counter()

        async def one(r: Request) -> None:
            record = Record(time.perf_counter() - start)
            body = {"model": model, "messages": r.messages, "max_tokens": r.output_tokens,
                    "stream": True, "temperature": 0.0}
            try:
                async with http.stream("POST", "/chat/completions", json=body) as reply:
                    if reply.status_code != 200:
                        await reply.aread()
                        record.error = str(reply.status_code)
                    else:
                        async for line in reply.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                record.error = "stream error"
                                break
                            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                            if delta.get("content"):
                                record.pieces.append((time.perf_counter() - start, 1))
                                progress.add(tokens=1)
            except httpx.HTTPError as e:
                record.error = type(e).__name__
            records[r.index] = record
            progress.add(done=1)

        await _closed_loop(requests, concurrency, one)
    return records


async def _closed_loop(requests: list[Request], concurrency: int, one) -> None:
    pending = iter(requests)

    async def client_task() -> None:
        for r in pending:  # shared: each task takes the next request
            await one(r)

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(requests))):
            tg.start_soon(client_task)


# ---- the run -------------------------------------------------------------------------

def run(args) -> int:
    try:
        levels = concurrency_list(args.concurrency or "8,16,48")
        prompt_words = Lengths.parse(args.prompt_words)
        max_tokens = Lengths.parse(args.max_tokens)
    except ValueError as e:
        print(f"pdmesh bench: {e}")
        return 2
    if args.ttft_slo <= 0 or args.itl_slo <= 0:
        print("pdmesh bench: --ttft-slo and --itl-slo must be positive")
        return 2
    requests = chat_requests(args.requests or 300, prompt_words, max_tokens, args.seed)
    mesh = None
    router, bootstrap = args.router, args.bootstrap
    if router is None:
        import shlex

        from pdmesh.localmesh import start_mesh

        out_dir = Path(args.out).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        mesh = start_mesh(out_dir, model=args.model, device=args.device, timeout=300.0,
                          up_args=shlex.split(args.mesh_args))
        router, bootstrap = f"http://127.0.0.1:{mesh.http_port}", mesh.bootstrap
        print(f"started pdmesh up --model {args.model} {args.mesh_args} (log {mesh.log_path})")
    http = router.startswith("http://") or router.startswith("https://")
    figures = MeshFigures(bootstrap)
    results = []
    try:
        for level in levels:
            before = figures.read()
            send = _send_http if http else _send_grpc
            t0 = time.perf_counter()
            with Progress(f"chat x{level}", len(requests)) as progress:
                records = anyio.run(send, router, requests, level, progress)
            wall = time.perf_counter() - t0
            quiet = figures.quiescence()
            after = figures.read()
            row = level_figures(records, wall, http, args.ttft_slo, args.itl_slo,
                                MeshFigures.queue(before, after),
                                MeshFigures.preemptions(before, after))
            row.update(concurrency=level, quiescence=quiet)
            results.append(row)
    finally:
        if mesh is not None:
            mesh.stop()
    result = {
        "workload": {"name": "chat", "requests": len(requests),
                     "prompt_words": str(prompt_words), "max_tokens": str(max_tokens),
                     "seed": args.seed, "api": "http" if http else "grpc",
                     "router": router, "model": args.model if mesh else None},
        "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo},
        "levels": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"JSON: {out}")
    return 0


def print_table(result: dict) -> None:
    def ms(d: dict, q: str) -> str:
        return "-" if d.get(q) is None else f"{1e3 * d[q]:.0f}"

    slo = result["slo"]
    print()
    print(f"{'conc':>4} {'done':>5} {'refused':>8} {'other':>5} {'goodput':>8} {'good/s':>6} "
          f"{'TTFT p50/p90/p99 ms':>20} {'ITL p50/p90/p99 ms':>19} {'queued':>6} "
          f"{'wait ms':>7} {'preempt':>7} {'wall s':>6} quiet")
    for r in result["levels"]:
        other = sum(r["errors"].values()) - r["refused"]
        q = r["queue"]
        wait = "-" if q.get("mean_s") is None else f"{1e3 * q['mean_s']:.0f}"
        queued = "-" if q.get("waited") is None else str(q["waited"])
        pre = "n/a" if r["preemptions"] is None else f"{r['preemptions']:.0f}"
        quiet = r["quiescence"]
        quiet_text = "-" if quiet is None else (
            f"{'ok' if quiet['quiet_within_1s'] else 'SLOW'} {quiet['quiet_s']}s, "
            f"{quiet['pinned']} pinned, {quiet['pages_held']} pages")
        ttft = "/".join(ms(r["ttft_s"], q) for q in ("p50", "p90", "p99"))
        itl = "/".join(ms(r["itl_s"], q) for q in ("p50", "p90", "p99"))
        good_s = "-" if r["goodput_req_s"] is None else f"{r['goodput_req_s']:.2f}"
        print(f"{r['concurrency']:>4} {r['completed']:>5} "
              f"{r['refused']:>4} {100 * r['refused_fraction']:>2.0f}% {other:>5} "
              f"{100 * r['goodput_fraction']:>7.0f}% {good_s:>6} {ttft:>20} {itl:>19} "
              f"{queued:>6} {wait:>7} {pre:>7} {r['wall_s']:>6.1f} {quiet_text}")
    print(f"(refused: 429/503 or RESOURCE_EXHAUSTED/UNAVAILABLE; goodput: TTFT <= "
          f"{slo['ttft_s']} s and mean inter-token gap <= {slo['itl_s']} s; queued: requests "
          f"that waited > 5 ms in the router's queue, wait: mean over all; preempt: n/a when "
          f"no member exposes pdmesh_preemptions_total; quiet: inflight 0 and no KV page "
          f"held on every member, within {QUIET_WITHIN:g} s)")
    for r in result["levels"]:
        if r["errors"]:
            print(f"x{r['concurrency']} errors by code: {r['errors']}")


__all__ = ["run", "concurrency_list", "chat_requests", "goodput", "percentiles"]
