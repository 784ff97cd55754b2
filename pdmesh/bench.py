"""`pdmesh bench`: the mesh vs transformers benchmark; the code lives in bench/mesh_bench.py.

The arguments are defined here once: bench/mesh_bench.py builds its own parser from
``add_arguments`` and ``run`` turns the parsed namespace back into its argv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def to_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        "--out", args.out, "--model", args.model, "--tokens", str(args.tokens),
        "--streams", str(args.streams), "--reps", str(args.reps),
        "--prompt-tokens", str(args.prompt_tokens), "--transfer-reps", str(args.transfer_reps),
        "--transfer-runs", str(args.transfer_runs),
        "--prefill", str(args.prefill), "--decode", str(args.decode), "--dtype", args.dtype,
        "--hf-dtype", args.hf_dtype,
    ]
    for flag in ("skip_transfer", "skip_hf", "skip_engine", "skip_mesh"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for kv in args.mesh_env:
        argv += ["--mesh-env", kv]
    return argv


def run(args: argparse.Namespace) -> int:
    # bench/ is not an installed package: import it from the repository this file lives in.
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.mesh_bench import main

    return main(to_argv(args))
