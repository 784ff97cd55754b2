"""Development benchmarks and checks, run from the repository root as ``python -m bench.NAME``.

The benchmarks a user runs against an installed pdmesh live in the ``pdmesh.bench`` package
(``pdmesh bench``); these need the repository (its tests' data, each other).
"""
