"""Block-scale layouts: linear [rows, K/16] (checkpoints) <-> 128x4-tile swizzle (cuBLASLt,
CUTLASS, FlashInfer FP4 GEMMs).

The swizzle pads rows to 128 and scale columns to 4 with zeros, then orders each 128x4 tile
so the scale for (r, c) sits at byte
    ((r // 128) * (Kp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4.
This is pure byte movement, done once when weights load, so it has no device dispatch.
"""

import torch


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _tile_permute(t: torch.Tensor, mp: int, kp: int, rows_first: bool) -> torch.Tensor:
    # (tile_r, 4, 32, tile_c, 4) <-> (tile_r, tile_c, 32, 4, 4): the permute swaps dims 1 and
    # 3, so it is its own inverse; only the view shape differs between the two directions.
    shape = (mp // 128, 4, 32, kp // 4, 4) if rows_first else (mp // 128, kp // 4, 32, 4, 4)
    return t.reshape(shape).permute(0, 3, 2, 1, 4).reshape(mp, kp)


def swizzle_scales(scales_2d: torch.Tensor) -> torch.Tensor:
    """Linear [rows, cols] scales -> swizzled, contiguous [Mp, Kp] (Mp = rows padded to 128,
    Kp = cols padded to 4, padding zero); flatten it to index with the byte formula."""
    if not isinstance(scales_2d, torch.Tensor) or scales_2d.ndim != 2:
        raise ValueError("scales_2d must be a 2-D tensor [rows, K/16]")
    if scales_2d.element_size() != 1:
        raise TypeError(f"scales must be a 1-byte dtype (float8_e4m3fn), got {scales_2d.dtype}")
    rows, cols = scales_2d.shape
    mp, kp = _padded(rows, 128), _padded(cols, 4)
    padded = torch.zeros(mp, kp, dtype=torch.uint8, device=scales_2d.device)
    padded[:rows, :cols] = scales_2d.view(torch.uint8)  # bytes: float8 has few kernels
    return _tile_permute(padded, mp, kp, rows_first=True).view(scales_2d.dtype)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled scales (any shape holding Mp*Kp bytes) -> linear, contiguous [rows, cols]."""
    if not isinstance(swizzled, torch.Tensor) or swizzled.element_size() != 1:
        raise TypeError("swizzled must be a tensor of a 1-byte dtype (float8_e4m3fn)")
    if rows <= 0 or cols <= 0:
        raise ValueError(f"rows and cols must be positive, got {rows}, {cols}")
    mp, kp = _padded(rows, 128), _padded(cols, 4)
    if swizzled.numel() != mp * kp:
        raise ValueError(
            f"swizzled has {swizzled.numel()} elements; [{rows}, {cols}] pads to "
            f"[{mp}, {kp}] = {mp * kp}"
        )
    linear = _tile_permute(swizzled.contiguous().view(torch.uint8), mp, kp, rows_first=False)
    return linear[:rows, :cols].contiguous().view(swizzled.dtype)
