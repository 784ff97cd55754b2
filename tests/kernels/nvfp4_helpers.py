"""Shared helpers for the NVFP4 tests."""

import torch

from libs.kernels.nvfp4 import reference

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def block_with_anchor(values) -> torch.Tensor:
    """One 16-element fp32 block: `values`, padded with zeros, plus a 6.0 in the last slot so
    that with global_scale 1.0 the block scale is exactly 6 / (6 * 1) = 1 and y == x."""
    values = list(values)
    assert len(values) <= 15
    return torch.tensor(values + [0.0] * (15 - len(values)) + [6.0], dtype=torch.float32)


def codes_of(packed: torch.Tensor) -> list[int]:
    return reference.unpack(packed).flatten().tolist()
