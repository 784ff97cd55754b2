"""`pdmesh bench`: placeholder arguments; the benchmark lives in bench/mesh_bench.py."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench-results/mesh.json", help="JSON output path")


def run(args: argparse.Namespace) -> int:
    from bench.mesh_bench import main

    return main(["--out", args.out])
