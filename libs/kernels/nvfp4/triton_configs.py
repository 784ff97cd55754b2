"""Which config triton_kernel.py's Triton kernel runs a call with: tile sizes, split K,
pipeline depth and decode form (pick_config), and when a small layer's call counts as
"few tokens" (few_tokens, which small_configs.phased_config also asks). Plain Python on
ints, without Triton, so the rules are tested everywhere (tests/kernels/test_nvfp4_routing.py).
"""

from .grid import cdiv


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Tile sizes, split-K and decode for an [m, k] x [n, k]^T product.

    Each program decodes its weight tile in registers and waits for its tensor-core work
    before reusing them, so throughput comes from several programs per SM overlapping one
    another: K is split until there are about six programs per SM (three for the larger
    8-warp tiles; at least two K steps each). Small M streams weights: 64-row tiles (128
    rows and ~2 programs per SM on layers with K >= 8192), a 16-wide token side, the
    inline-PTX decode. Larger M is tensor-core work: 128-row tiles on two warpgroups; above
    M = 64 the plain Triton decode, which Triton schedules better around the MMAs.
    Small layers (under 2^22 weights) are latency-bound. Few tokens (few_tokens): K split
    into whole runs of steps (_small_layer_split). More tokens: K in runs of at most 576,
    each run's loads all in flight at once, 32-token tiles where they still make 64 tiles
    (_small_layer_runs)."""
    return _config(m, n, k, sms, few_tokens(m, n, k, sms))


def _config(m: int, n: int, k: int, sms: int, few: bool) -> dict:
    """pick_config's config, with or without its few-token form (few)."""
    # Long rows (K >= 8192, at least 2048 rows) take 128-row tiles at few tokens; shorter
    # ones keep 64-row tiles, which fill more SMs.
    big = n >= 2048 and k >= 8192
    small = n * k < 2**22
    per_sm = 6 if few else 3  # the 8-warp tiles need fewer programs per SM
    if few:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                   DECODE_ASM=True)
        if k <= 768:
            cfg["BLOCK_K"] = 64
        if big:  # 128 weight rows per warpgroup (two independent MMA chains), ~2 per SM
            cfg["BLOCK_N"] = 128
            per_sm = 2
    elif small:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64 if k < 1024 else 128, num_warps=4,
                   num_stages=3, DECODE_ASM=True)
        if cdiv(n, 64) * cdiv(m, 32) >= 64:  # 32-token tiles where they still make 64 tiles
            cfg["BLOCK_M"] = 32
    elif m <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3,
                   DECODE_ASM=True)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3,
                   DECODE_ASM=False)
    # The masked K path (K not a multiple of BLOCK_K * SPLIT_K) loses the 16-byte loads and
    # runs several times slower, so take the largest K step (down to 16, which always
    # divides K) that divides K, and only splits that divide the number of steps.
    while k % cfg["BLOCK_K"] and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    tiles = cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"])
    k_steps = cdiv(k, cfg["BLOCK_K"])
    if small:
        if few:
            cfg["SPLIT_K"] = _small_layer_split(k_steps, tiles, sms)
        else:
            _small_layer_runs(cfg, k_steps)
        return cfg
    split_k = 1
    if k > 768:
        while (tiles * split_k * 2 <= per_sm * sms and k_steps // (split_k * 2) >= 2
               and k_steps % (split_k * 2) == 0):
            split_k *= 2
    cfg["SPLIT_K"] = split_k
    return cfg


def few_tokens(m: int, n: int, k: int, sms: int = 132) -> bool:
    """Whether pick_config's few-token config (16-token tiles of 64 rows, K split into runs)
    takes the call: up to 16 tokens, and 17-32 on layers of under 2^22 weights where K is
    2048 or more (eight or more of small_phased_kernel's phases, whose 32-row boxes are slow
    there), or 1536 or more with that config's programs in one wave (SmolLM2's down
    projection, 576 x 1536). small_configs.phased_config declines these calls; K of 1280
    and less, and 33 tokens and more, keep the phased kernel."""
    if m <= 16:
        return True
    if m > 32 or n * k >= 2**22 or k < 1536:
        return False
    if k >= 2048:
        return True
    cfg = _config(m, n, k, sms, few=True)
    return cdiv(n, cfg["BLOCK_N"]) * cdiv(m, cfg["BLOCK_M"]) * cfg["SPLIT_K"] <= sms


def _small_layer_split(k_steps: int, tiles: int, sms: int) -> int:
    """SPLIT_K for a layer of under 2^22 weights (SmolLM2's) at up to 16 tokens: the largest
    number of whole runs of at least two K steps that keeps to about four programs an
    SM. Large-layer tiles leave most SMs idle there, and a split need not be a power of
    two, only divide the steps (SmolLM2's 576 is nine 64-wide steps)."""
    return max(s for s in range(1, k_steps + 1)
               if k_steps % s == 0 and (s == 1 or (k_steps // s >= 2
                                                   and tiles * s <= 4 * sms)))


def _small_layer_runs(cfg: dict, k_steps: int) -> None:
    """SPLIT_K and num_stages for a small layer at more than 16 tokens: the fewest runs of
    at most 576 of K that divide the steps, and a software pipeline one deeper than a run
    (at most 10), so every load of a run is issued before the first step is decoded. Each
    program is one latency chain (loads, then per step a decode and a wgmma it waits for),
    and a global split-K sum adds a round trip, so long runs whose loads all fly at once
    beat short ones."""
    cfg["SPLIT_K"] = min(s for s in range(1, k_steps + 1)
                         if k_steps % s == 0 and k_steps // s * cfg["BLOCK_K"] <= 576)
    cfg["num_stages"] = min(k_steps // cfg["SPLIT_K"] + 1, 10)
