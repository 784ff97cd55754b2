"""The whole mesh as a benchmark side: `pdmesh up` started here, driven through the public
gRPC client, as a user's program would.

    pdmesh bench [--device cpu|cuda] [--streams 16] [--rate R] [--out FILE.json] ...
    python -m pdmesh.bench.mesh ...     (the same flags; --help lists them)

`MeshSide.serve` sends a workload's requests (pdmesh/bench/workload.py) as concurrent
streams from one asyncio client: closed loop, a fixed number of client tasks each sending
its next request when the last one ended; open loop, each request sent at its Poisson
arrival time. Every streamed piece is stamped as it arrives. Around each run it reads
the CPU seconds each mesh process used (Linux /proc) and the prefills' KV transfer
histograms (pdmesh_kv_transfer_seconds / _bytes on their /metrics), so a run also says
how many bytes of KV moved and how long a room's transfer took.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import grpc

from pdmesh.bench.progress import Progress
from pdmesh.bench.workload import Record, Workload


class MeshSide:
    """A local mesh for the length of a benchmark (``stop`` ends it)."""

    def __init__(self, args, out_dir: Path) -> None:
        from pdmesh.localmesh import start_mesh

        env = dict(kv.split("=", 1) for kv in args.mesh_env)
        t0 = time.perf_counter()
        self.mesh = start_mesh(
            out_dir, model=args.model, prefill=args.prefill, decode=args.decode,
            extra_env=env, timeout=300.0, device=args.device, dtype=args.dtype,
            up_args=["--weights", args.weights, *shlex.split(args.mesh_args)],
        )
        self.startup_s = time.perf_counter() - t0
        self.pids = _service_pids(self.mesh)

    @property
    def log_path(self) -> Path:
        return self.mesh.log_path

    def quiet(self) -> None:
        """Wait until no member holds a request or a KV page (between runs)."""
        from pdmesh.localmesh import wait_quiet

        wait_quiet(self.mesh, 30)

    def serve(self, workload: Workload, progress: Progress) -> tuple[list[Record], dict]:
        """The records, and what the mesh's processes spent: CPU seconds, KV moved and the
        decode's mean step by part."""
        cpu_before = {k: _proc_cpu(p) for k, p in self.pids.items()}
        kv_before = self.transfer_counters()
        steps_before = self.step_counters()
        t0 = time.perf_counter()
        records = _run(_serve, self.mesh.router, workload, progress)
        wall = time.perf_counter() - t0
        cpu_after = {k: _proc_cpu(p) for k, p in self.pids.items()}
        kv = {k: v - kv_before[k] for k, v in self.transfer_counters().items()}
        steps = {k: v - steps_before.get(k, 0.0) for k, v in self.step_counters().items()}
        n_steps = int(steps.pop("steps"))
        rooms = kv["rooms"]
        spent = {
            "cpu_s": {k: round(cpu_after[k] - cpu_before[k], 3) for k in self.pids
                      if cpu_after[k] is not None and cpu_before[k] is not None},
            "wall_s": wall,
            "kv_transfer": {
                "rooms": int(rooms), "bytes": int(kv["bytes"]),
                "seconds": kv["seconds"],
                "mean_ms": 1e3 * kv["seconds"] / rooms if rooms else None,
                "bytes_per_room": kv["bytes"] / rooms if rooms else None,
                "descriptors": int(kv["descriptors"]) if kv["gbps_rooms"] else None,
                "write_gbps_mean": kv["gbps_sum"] / kv["gbps_rooms"] if kv["gbps_rooms"] else None,
                "tail_ms": 1e3 * kv["tail_seconds"] / rooms if rooms else None,
            },
            # the decode's mean step, by part (where its host time goes)
            "decode_steps": {"steps": n_steps, "ms": {
                part: 1e3 * v / n_steps for part, v in steps.items()} if n_steps else {}},
        }
        return records, spent

    def transfer_counters(self) -> dict[str, float]:
        """Rooms, bytes and seconds of KV transfer so far, summed over the prefills, and
        NIXL descriptors and write GB/s where the prefills report them.

        A room's seconds run from its first chunk written to its KvReady, so they include
        prefill work the transfer overlaps; its GB/s is its last write's, post to done."""
        names = {
            "pdmesh_kv_transfer_seconds_count": "rooms",
            "pdmesh_kv_transfer_seconds_sum": "seconds",
            "pdmesh_kv_transfer_bytes_sum": "bytes",
            "pdmesh_kv_transfer_descriptors_sum": "descriptors",
            "pdmesh_kv_transfer_gbps_sum": "gbps_sum",
            "pdmesh_kv_transfer_gbps_count": "gbps_rooms",
            "pdmesh_kv_transfer_tail_seconds_sum": "tail_seconds",
        }
        totals = dict.fromkeys(names.values(), 0.0)
        for sample in self._samples("prefill"):
            if sample.name in names and sample.labels.get("kind", "moved") == "moved":
                totals[names[sample.name]] += sample.value
        return totals

    def step_counters(self) -> dict[str, float]:
        """Decode steps so far and their seconds by part (services/decode/batcher.py),
        summed over the decodes."""
        totals: dict[str, float] = {"steps": 0.0}
        for sample in self._samples("decode"):
            if sample.name == "pdmesh_decode_steps_total":
                totals["steps"] += sample.value
            elif sample.name == "pdmesh_decode_step_seconds_total":
                part = sample.labels["part"]
                totals[part] = totals.get(part, 0.0) + sample.value
        return totals

    def _samples(self, role: str):
        """Every Prometheus sample of the members of ``role``."""
        from prometheus_client.parser import text_string_to_metric_families

        for member in self.mesh.status()["members"]:
            if member["role"] != role or not member.get("metrics"):
                continue
            with urllib.request.urlopen(member["metrics"], timeout=5) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                yield from family.samples

    def status(self) -> dict | str:
        try:
            return self.mesh.status()
        except Exception as e:  # informative only
            return repr(e)

    def stop(self) -> None:
        self.mesh.stop()


def _run(fn, *args):
    """anyio.run on uvloop where installed: the client is one process for every stream."""
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    return anyio.run(fn, *args, backend="asyncio", backend_options=options)


async def _serve(address: str, workload: Workload, progress: Progress) -> list[Record]:
    from pdmesh.client import GenerateClient, Piece

    reqs = workload.requests
    records: list[Record | None] = [None] * len(reqs)
    async with GenerateClient(address, timeout=600.0) as client:
        model = (await client.models())[0]
        start = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - start

        async def one(r, sent: float) -> None:
            record = Record(sent)
            prompt = {"prompt": r.text} if r.text is not None else {"messages": r.messages}
            try:
                async for event in client.generate(model=model, max_tokens=r.output_tokens,
                                                   temperature=0.0, ignore_eos=True, **prompt):
                    if isinstance(event, Piece) and event.token_ids:
                        record.pieces.append((now(), len(event.token_ids)))
                        record.token_ids += event.token_ids
                        progress.add(tokens=len(event.token_ids))
            except grpc.aio.AioRpcError as e:
                record.error = e.code().name
            records[r.index] = record
            progress.add(done=1)

        async with anyio.create_task_group() as tg:
            if workload.rate:
                for at, r in zip(workload.arrivals(), reqs, strict=True):
                    await anyio.sleep(max(0.0, at - now()))
                    tg.start_soon(one, r, now())
            else:
                pending = iter(reqs)

                async def client_task() -> None:
                    for r in pending:  # shared: each task takes the next request
                        await one(r, now())

                for _ in range(min(workload.concurrency, len(reqs))):
                    tg.start_soon(client_task)
    return records


def _proc_cpu(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _service_pids(mesh) -> dict[str, int]:
    """The mesh's processes by service name, plus this benchmark's client process."""
    pids = {"supervisor": mesh.process.pid, "bench-client": os.getpid()}
    for pid in mesh.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        name = argv[argv.index("--name") + 1] if "--name" in argv else None
        role = argv[argv.index("pdmesh.cli") + 1] if "pdmesh.cli" in argv else str(pid)
        pids[name or role] = pid
    return pids


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pdmesh.bench import add_arguments, run

    parser = argparse.ArgumentParser(prog="python -m pdmesh.bench.mesh")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
