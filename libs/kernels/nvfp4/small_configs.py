"""Which config small_kernel.py's small-layer kernel runs a call with (pick_config), and the
bound on K that its shared memory sets (MAX_K). Plain Python on ints and dicts, without
Triton, so these rules are tested everywhere (tests/kernels/test_nvfp4_routing.py).
"""

from .grid import cdiv

# Shared memory one program may use on Hopper (H100, H200): 227 KB.
SMEM_BYTES = 227 * 1024
# The largest tile pick_config gives: 128 tokens (two warpgroups of 64) by 64 weight rows.
MAX_TILE_TOKENS = 128
MAX_TILE_ROWS = 64
# The kernel decodes a program's weight rows over the whole of K into shared memory and, in
# its TMA form, holds x's [tokens, K] tile there beside them: (128 + 64) x K x 2 bytes for
# the largest tile, so K stops at the last whole 64-wide chunk under SMEM_BYTES, 576.
# (The register form holds x's A fragments instead: K / 4 registers a thread, 144 at 576.)
# Longer K goes to small_phased_kernel, which streams x through a ring.
MAX_K = SMEM_BYTES // (2 * (MAX_TILE_TOKENS + MAX_TILE_ROWS)) // 64 * 64
X_REGS_MAX_M = 32  # up to here x goes straight to registers (see pick_config)


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether this kernel handles the call: K in whole 64-wide chunks, at most MAX_K."""
    return k % 64 == 0 and 0 < k <= MAX_K


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where another kernel runs:
    layers of 2^22 weights or more, and K past MAX_K or not a multiple of 64.

    Up to X_REGS_MAX_M tokens x goes through registers (a TMA box would fill a 64-token
    tile for them): 16 rows a program while at most two programs a SM (they fit: ~200
    registers a thread on 4 warps), else 32.

    Past that, x by TMA: the fewest weight rows a program, 16 then 32, whose programs fit
    in one wave, on one warpgroup (64 tokens a program) before two (128, past 64 tokens).
    Where neither does (wide layers such as the engine's fused gate_up, 3072 x 576, from
    129 tokens; long prompts), 64 rows a program, then 64 rows on two warpgroups in as
    many waves as it takes."""
    if n * k >= 2**22 or not fits(m, k, {}):
        return None
    if m <= X_REGS_MAX_M:
        for bn in (16, 32):
            if cdiv(n, bn) <= 2 * sms:
                return dict(BN=bn, num_warps=4, X_REGS=True)
        return None
    for bn in (16, 32, 64):
        for w in (4, 8) if m > 64 else (4,):
            if bn * 8 >= 32 * w and cdiv(n, bn) * cdiv(m, 16 * w) <= sms:
                return dict(BN=bn, num_warps=w)
    return dict(BN=64, num_warps=8)
