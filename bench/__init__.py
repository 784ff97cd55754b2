"""Benchmarks (run from the repository root): mesh_bench, transfer_bench."""
