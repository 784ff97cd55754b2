"""Which config gemm_kernel.py's GEMM runs a call with, and what its launch does around the
kernel: the token tile, K split and x ring a call gets (pick_config), the calls split into
two launches (whole_tiles_first), the small layers' configs, whether a call fits, whether x
is copied into whole tiles first or the last tile moves back to end at M (needs_pad,
shifts). Plain Python on ints and dicts, without Triton, so these rules are tested
everywhere (tests/kernels/test_nvfp4_gemm_configs.py), as dequantize_route.py's are.
"""

from .grid import cdiv, shifts_last_tile


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where linear_kernels' Triton
    kernel runs instead: at most 16 tokens (the Triton kernel streams the weights faster
    there: 60 us against 67-70 us on 8192 x 28672), layers of 2^22 to 2^24 weights (not
    measured; smaller ones: _small_layer_config), N not a multiple of 8 (TMA rows of the
    output), K not a multiple of 256.

    64-row tiles; token tiles of the next power of two up to 128 tokens, else 256: one
    weight decode per token tile, so few and full tiles. Tiles of up to 128 tokens need
    128 registers a thread, so two programs share an SM and one decodes while the other's
    wgmmas run; 256-token tiles (a 128-register accumulator) run one per SM. 256-token
    tiles switch to 128 where they would leave half the SMs idle and 128-token ones not
    (4096 x 4096 at M = 256: 19.2 us against 22.0 us with K split in two). K is split in
    two or more while the tiles leave half the SMs idle, and for tiles of up to 128 tokens
    also up to two programs per SM while each split keeps 8192 of K (the split-K sum
    costs a few us: 8192 x 28672 at M = 128 takes 102 us split in two against 141 us
    whole; 4096 x 4096 at M = 256 takes 22.4 us split against 19.6 us whole). From sweeps
    on an H200 (docs/notes/nvfp4-triton.md, sessions `gluon-gemm` and `gemm-registers`).
    Some token counts past 256 on wide layers split into two launches (whole_tiles_first):
    the first launch's config then carries HEAD (its tokens) and REST (the rest's config)."""
    if m <= 16 or n % 8:
        return None
    if n * k < 2**22:
        return _small_layer_config(m, n, k, sms)
    if n * k < 2**24:
        return None
    head = whole_tiles_first(m, n, sms)
    if head:
        first, rest = pick_config(head, n, k, sms), pick_config(m - head, n, k, sms)
        if first and rest:
            return dict(first, HEAD=head, REST=rest)
    bm = 256 if m > 128 else max(16, 1 << (m - 1).bit_length())
    n_tiles = cdiv(n, 64)
    if bm == 256 and 2 * n_tiles * cdiv(m, 256) <= sms < 2 * n_tiles * cdiv(m, 128):
        bm = 128
    cfg = dict(BN=64, BM=bm, BK=64, G=4, STAGES=4, W_STAGES=2, SPLIT_K=1,
               maxnreg=128 if bm <= 128 else 232)
    if not fits(m, k, cfg):
        return None
    tiles = n_tiles * cdiv(m, bm)

    def may_split(per_sm: int, min_k: int) -> bool:
        twice = dict(cfg, SPLIT_K=cfg["SPLIT_K"] * 2)
        return (tiles * twice["SPLIT_K"] <= per_sm * sms and k // twice["SPLIT_K"] >= min_k
                and fits(m, k, twice))

    while may_split(1, 0):
        cfg["SPLIT_K"] *= 2
    while bm <= 128 and may_split(2, 8192):
        cfg["SPLIT_K"] *= 2
    if (bm == 256 and cfg["SPLIT_K"] == 1 and k >= 8192
            and 2 * cdiv(2 * tiles, sms) <= 3 * cdiv(tiles, sms)
            and fits(m, k, dict(cfg, SPLIT_K=2))):
        # Past one wave, whole-K tiles that leave the last wave part-empty: halves of K
        # fill it, in waves of half the length, where that is at most 3/4 of the time
        # (the split's sum costs the rest). A/B through the route on an H200, five
        # interleaved rounds, outputs checked against the exact product (docs/notes/
        # bench/gemm_split_256_ab.json), us, split against whole (torch), 192 tiles:
        # 4096 x 14336 / 4096 x 8192 / 4096 x 28672 at M = 520 141.5 / 84.6 / 271.6
        # against 160.6 / 89.0 / 352.6 (85.5 / 49.5 / 181.3), 6144 x 8192 at M = 400 85.8
        # against 92.0 (63.1). Not taken: 288 tiles (6144 x 8192 at M = 520: 5 half waves
        # against 3, 143.4 against 137.8), K = 4096 (4096 x 4096 at M = 520 51.0 against
        # 47.0, gemm_split_256_probe.json), and no fewer waves (4096 x 14336 at M = 800
        # 183 against 158, gemm_tile_sweep_520_1000.json).
        cfg["SPLIT_K"] = 2
    if bm == 256 or tiles * cfg["SPLIT_K"] <= sms:
        # One program per SM: x slots of two steps, three of them (half the x barrier
        # traffic, six steps of x in flight): 159.0 against 162-164 us on 8192 x 28672 at
        # M = 256, 18.2 against 19.1 us on 4096 x 4096. Two programs per SM could not hold
        # the larger ring (8192 x 28672 at M = 128: 120 against 102 us). Smaller tiles
        # leave room for a fourth slot (8192 x 8192 at M = 128: 31.7 against 34.7 us). And
        # the MMA warpgroup reads each step ahead (_mma_partition's LOOKAHEAD).
        cfg.update(X_STEPS=2, STAGES=3 if bm == 256 else 4, LOOKAHEAD=True)
    return cfg


def first_slots_early(k_steps: int) -> bool:
    """Whether the kernel's prologue issues the first weight and x slots itself
    (gemm_kernel._first_slots) for a program of k_steps 64-wide K steps: where the loop is
    short. Outputs bit-equal; one H200, five interleaved rounds, us, early against the
    loaders' own first issue (torch), docs/notes/bench/gemm_prologue_loads_probe.json:
    4096 x 4096 at M = 256 / 200 / 128 / 64 (64, 64, 32, 32 steps) 17.18 / 17.02 / 14.04 /
    11.92 against 17.82 / 17.34 / 14.29 / 12.21 (18.10 / 16.93 / 13.57 / 12.15); 8192 x
    8192 at M = 256 (128 steps) 46.85 against 47.52 (49.42). On 8192 x 28672 (448 and 224
    steps) it measured slower, 169.9 against 167.6 at M = 256 and 74.4 against 74.1 at
    M = 64, so long loops keep the loaders' issue. Through the route against the package
    before it (bit-equal; docs/notes/bench/gemm_first_slots_ab.json, ..._ab2.json): 4096 x
    4096 at M = 64 / 128 / 256 11.52 / 13.98 / 16.86 against 11.91 / 14.21 / 17.14 (torch
    11.92 / 13.70 / 16.71), 8192 x 8192 at M = 64 26.40 against 26.71, 576 x 1536 at
    M = 512 6.80 against 7.02 (5.48)."""
    return k_steps <= 128


def whole_tiles_first(m: int, n: int, sms: int) -> int:
    """The tokens of a first launch in whole 256-token tiles (gemm_kernel.launch runs the rest in
    the config picked for them), or 0 for one launch. Where M leaves 17-128 tokens past whole
    tiles and their row of 256-token tiles (one program an SM) would add a wave to the launch,
    the rest's own config (tiles of up to 128 tokens, two programs an SM) takes less. Same-run
    A/B through the route on an H200, five interleaved rounds, outputs checked against the exact
    product (docs/notes/bench/gemm_two_launches_ab.json), us, two launches against one (torch):
    8192 x 28672 at M = 300 / 384 / 600 262 / 274 / 465 against 340 / 351 / 538 (191 / 243 /
    391); 28672 x 8192 306 / 331 / 488 against 340 / 348 / 543 (210 / 243 / 434); 14336 x 4096
    76 / 77 / 129 against 97 / 97 / 146 (53 / 62 / 101); a second A/B (..._ab2.json): 4096 x
    4096 at M = 600 40.6 against 47.3 (28.1), 4096 x 14336 113 against 153 (92), 8192 x 28672 at
    M = 800 586 against 675 (556). In probes (gemm_two_launches_probe.json,
    gemm_tile_sweep_520_1000.json), where the whole tiles take as many waves as all of them, two
    launches lose or tie: 4096 x 4096 at M = 300 / 400 / 800 28.5 / 33.9 / 57.1 against 25.5 /
    25.2 / 48.7, 4096 x 14336 at M = 300 77 against 79; and so do 129 tokens or more past (the
    rest in 256-token tiles again: 8192 x 28672 at M = 450 367 against 366)."""
    rest, rows = m % 256, cdiv(n, 64)
    if m < 256 or not 16 < rest <= 128:
        return 0
    fewer_waves = cdiv(rows * (m // 256), sms) < cdiv(rows * cdiv(m, 256), sms)
    return m - rest if fewer_waves else 0


def _small_layer_config(m: int, n: int, k: int, sms: int) -> dict | None:
    """Layers under 2^22 weights come here only where small_kernel and small_phased_kernel
    decline them (route asks them first): K past small_kernel's 576, as SmolLM2's down
    projection (576 x 1536), at token counts past small_phased_kernel's one wave. Weight
    slots of 8 steps, two-step x slots read ahead, token tiles by count:
    - 129-256 tokens: 32 (two programs per SM). Session `small-wgmma`, 576 x 1536 at
      M = 256 6.47 us against the Triton kernel's 7.80 (torch 5.27); at M = 128 6.39
      against 6.33, at M = 64 6.38 against 5.27, so fewer tokens stay there.
    - more (prompts): 64 while the tiles fit in one wave, else 128. Session `long-prompts`
      (docs/notes/bench/long_m_sweep2.json), 576 x 1536, us, against the Triton kernel
      (torch): M = 768 64-token tiles 7.10 against 14.07 (5.82; 128-token tiles 8.31);
      M = 1024 / 1536 / 2048 / 4096 128-token tiles 8.29 / 8.40 / 14.90 / 21.91 against
      17.73 / 24.40 / 30.39 / 56.45 (5.81 / 6.93 / 8.06 / 11.89; 64-token tiles 9.93 /
      9.87 / 15.34 / 23.05)."""
    if m <= 128:
        return None
    bm = 32 if m <= 256 else 64 if cdiv(n, 64) * cdiv(m, 64) <= sms else 128
    cfg = dict(BN=64, BM=bm, BK=64, G=8 if k % 512 == 0 else 4, STAGES=4, W_STAGES=2,
               SPLIT_K=1, maxnreg=128, X_STEPS=2, LOOKAHEAD=True)
    return cfg if fits(m, k, cfg) else None


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether each K split is whole weight slots (G steps of BK)."""
    return k % (cfg["G"] * cfg["BK"] * cfg.get("SPLIT_K", 1)) == 0


def needs_pad(m: int, cfg: dict) -> bool:
    """Whether gemm_kernel.launch copies x into whole token tiles first: under one tile;
    past one, the last tile moves back to end at M instead (shifts)."""
    if "REST" in cfg:
        return needs_pad(m - cfg["HEAD"], cfg["REST"])
    return bool(m < cfg["BM"] and cfg.get("PAD_X", cfg["BM"] >= 128))


def shifts(m: int, cfg: dict) -> bool:
    """Whether the last token tile starts at M - BM (M past one tile, not whole tiles)."""
    return shifts_last_tile(m, cfg["BM"])


def head_config(cfg: dict) -> dict:
    """The first launch's config of a HEAD / REST pair (whole_tiles_first)."""
    return {key: v for key, v in cfg.items() if key not in ("HEAD", "REST")}
