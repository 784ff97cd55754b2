"""Which config small_phased_kernel.py's kernel runs a call with (pick_config), and the shape
of its x ring: slots (ring_slots), box rows (x_rows), whether the decode runs in three
groups (split_decode). Plain Python on ints and dicts, without Triton, so these rules are
tested everywhere (tests/kernels/test_nvfp4_routing.py).
"""

from .grid import cdiv
from .triton_configs import few_tokens

XC = 4  # chunks of 64 K a ring slot
XS = 3  # ring slots: 3 x 4 x 64 tokens x 64 x 2 bytes = 96 KB of x (ring_slots: 4-5 at times)
# ring_slots' bound on the decoded weights and the ring: Hopper's 227 KB a program, less
# room for the barriers and the compiler's scratch
SMEM_BYTES = 226 * 1024
FITS_BYTES = 220 * 1024  # fits' bound on the weights beside the shallowest ring


def tile_rows(bn: int) -> int:
    """The weight rows of a program's tile: BN, or 32 for BN = 24 (the kernel's
    _decode_rows24; small_phased_kernel.tile_rows gives it the same at compile time)."""
    return 32 if bn == 24 else bn


def _shared_bytes(bn: int, k: int, slots: int) -> int:
    """The decoded weights (tile_rows(BN) x K x 2 bytes) and the ring's slots of x."""
    return tile_rows(bn) * k * 2 + slots * XC * 64 * 64 * 2


def ring_slots(k: int, bn: int, one_box: bool) -> int:
    """x's ring slots: a deeper ring where K is five or six phases (1280 or 1536; six is
    SmolLM2's down projection), 4 slots where a slot is one box (64-token tiles) and 5
    where it is XC 32-row copies (17-32 tokens), the most of those that fit beside the
    decoded weights (5 slots at 16 rows, 4 at 32 rows: 229,408 bytes); else XS, where
    deeper rings do not pay."""
    want = (4 if one_box else 5) if k // (64 * XC) in (5, 6) else XS
    return next((s for s in range(want, XS, -1) if _shared_bytes(bn, k, s) <= SMEM_BYTES), XS)


def split_decode(k: int, bn: int, xr: int, slots: int) -> bool:
    """Whether the kernel decodes in three groups (SPLIT) instead of all at once: at
    BN = 24 with 64-token boxes, where at least two phases wait for a refill of the
    ring (SmolLM2's down projection: six phases, four slots). All-at-once, the refills
    go out only after the whole decode and the first phase's wgmmas, so the last
    phases' x arrives late. Split, phases 0-1 are decoded and issued first, 2-3 decoded
    while they run, then slots 0-1 refilled, 2-3 issued and 4-5 decoded while their x
    arrives. The first group's phases must all be in the ring at the start (fewer
    refilled phases than slots)."""
    refilled = k // (64 * XC) - slots
    return bn == 24 and xr == 64 and 2 <= refilled < slots


def x_rows(m: int) -> int:
    """Token rows of x's TMA box: 32 up to 32 tokens, else a whole tile of 64. The box's
    size costs, not the rows read, so few tokens take the smaller box. Gluon's TMA boxes
    have power-of-two rows, so 33-63 tokens keep 64."""
    return 32 if m <= 32 else 64


def fits(m: int, k: int, cfg: dict) -> bool:
    """K in whole phases of XC chunks, at least XS of them, the weights' shared memory
    (BN x K x 2 bytes) beside the ring under FITS_BYTES."""
    bn = cfg.get("BN", 16)
    return (k % (64 * XC) == 0 and k // (64 * XC) >= XS
            and _shared_bytes(bn, k, XS) <= FITS_BYTES)


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where another kernel runs:
    triton_configs.few_tokens (1-16 tokens, and 17-32 where K is 2048 or more, or 1536
    with the Triton kernel's programs in one wave), layers of 2^22 weights or more, K
    this kernel does not fit, token counts past one wave at 32 rows, and the calls
    long_and_light names. The fewest rows (16, then 24, then 32) whose programs fit in
    one wave, as small_configs picks: at 193-256 tokens on SmolLM2's down projection
    that is 24 rows (96 programs, where 16 rows take 144)."""
    if few_tokens(m, n, k, sms) or n * k >= 2**22 or long_and_light(m, n, k):
        return None
    for bn in (16, 24, 32):
        cfg = dict(BN=bn, num_warps=4)
        if fits(m, k, cfg) and cdiv(n, bn) * cdiv(m, 64) <= sms:
            return cfg
    return None


def long_and_light(m: int, n: int, k: int) -> bool:
    """Whether the Triton kernel (its own config for m tokens) takes a call past
    few_tokens' 32 tokens: K of 2048 or more (eight phases and up, a long chain a
    program) at up to 128 tokens and under 2^27 multiply-adds, where that kernel, which
    splits K over more programs, is faster (from 2^27 the dequantize route takes its
    bf16 calls). Its outputs are exact to the same bound, not bit-equal to this kernel's."""
    return k >= 2048 and 32 < m <= 128 and m * n * k < 2**27
