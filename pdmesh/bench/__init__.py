"""`pdmesh bench`: the mesh against transformers `generate`, and NIXL against memcpy.

This module holds the command's flags and imports nothing heavy, so `pdmesh --help` stays
fast; the benchmarks themselves are the modules beside it, each also runnable with
``python -m``:

    pdmesh.bench.mesh      the mesh vs transformers (what `pdmesh bench` runs)
    pdmesh.bench.transfer  KV transfer: NIXL WRITE between two processes vs memcpy
    pdmesh.bench.engine    the engine alone (no services) vs transformers, on any device
"""

from __future__ import annotations

import argparse
import os

# Before torch is imported: the benchmarks run processes side by side, and OpenMP's default
# busy-wait makes each one spin against the others (10-30x slower small ops).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DESCRIPTION = """\
Starts a mesh (--prefill/--decode processes) on --model and measures it against transformers
`generate` on the same weights, one side after the other, never concurrently:

  single-stream decode tok/s    one greedy stream of --tokens new tokens (EOS ignored)
  --streams aggregate tok/s     that many concurrent streams, wall time incl. prefill
  time to first token           one --prompt-tokens prompt: request sent to first token
  KV transfer GB/s              NIXL WRITE between two processes vs copy_ of the same bytes
                                (python -m pdmesh.bench.transfer, --transfer-runs times)

plus the engine alone in this process (the time breakdown) and each mesh process's CPU
seconds. Prints a table (ratio > 1 means the mesh wins) and writes every raw figure to --out.
Targets: mesh >= 1.0x transformers single-stream, >= 1.5x at 16 streams; transfer >= 70% of
a one-thread memcpy. The best of --reps repetitions is reported (rates: max, times: min).

examples:
  pdmesh bench                                        SmolLM2-135M fp32, the full run
  pdmesh bench --dtype bfloat16                       the mesh in bf16, the baseline in fp32
  pdmesh bench --model tiny --tokens 8 --streams 2 --reps 1 --skip-transfer
                                                      a quick smoke test (no baseline)

the benchmarks alone:
  python -m pdmesh.bench.transfer      KV transfer only (UCX_* from the environment)
  python -m pdmesh.bench.engine        the engine without services vs transformers, any device
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default="bench-results/mesh.json", help="JSON output path")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default) | tiny (quick smoke test, no transformers side)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per stream (64)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (16)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions; best is reported (2)")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="length of the long prompt for time to first token (1024)")
    parser.add_argument("--transfer-reps", type=int, default=10,
                        help="repetitions per KV transfer case (10)")
    parser.add_argument("--transfer-runs", type=int, default=2,
                        help="runs of the transfer bench per memcpy variant; best kept (2)")
    parser.add_argument("--skip-transfer", action="store_true", help="no KV transfer bench")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--skip-engine", action="store_true",
                        help="no in-process engine diagnostics (the time breakdown)")
    parser.add_argument("--skip-mesh", action="store_true", help="no mesh (baseline only)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the mesh's dtype (default float32)")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the transformers baseline's dtype (default float32)")
    parser.add_argument("--prefill", type=int, default=1, help="mesh prefill processes (1)")
    parser.add_argument("--decode", type=int, default=1, help="mesh decode processes (1)")
    parser.add_argument("--mesh-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the mesh's processes (repeatable)")


def run(args: argparse.Namespace) -> int:
    from pdmesh.bench.mesh import bench

    return bench(args)
