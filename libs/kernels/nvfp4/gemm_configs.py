"""Which config gemm_kernel.py's GEMM runs a call with, and what its launch does around the
kernel: the token tile, K split and x ring a call gets (pick_config), the calls split into
two launches (whole_tiles_first), the small layers' configs, whether a call fits, whether x
is copied into whole tiles first or the last tile moves back to end at M (needs_pad,
shifts). Plain Python on ints and dicts, without Triton, so these rules are tested
everywhere (tests/kernels/test_nvfp4_routing.py).
"""

from .grid import cdiv, shifts_last_tile


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where another kernel runs: at
    most 16 tokens (the Triton kernel streams the weights faster there), N not a multiple
    of 8 (TMA rows of the output), K not a multiple of 256. Layers under 2^22 weights take
    _small_layer_config, layers of 2^22 to 2^24 _mid_layer_config.

    64-row tiles; token tiles of the next power of two up to 128 tokens, else 256: one
    weight decode per token tile, so few and full tiles. Tiles of up to 128 tokens need
    128 registers a thread, so two programs share an SM and one decodes while the other's
    wgmmas run; 256-token tiles (a 128-register accumulator) run one per SM. 256-token
    tiles switch to 128 where they would leave half the SMs idle and 128-token ones not.
    K is split in two or more while the tiles leave half the SMs idle, and for tiles of up
    to 128 tokens also up to two programs per SM while each split keeps 8192 of K (the
    split-K sum costs a few us, so short K stays whole).
    Some token counts past 256 on wide layers split into two launches (whole_tiles_first):
    the first launch's config then carries HEAD (its tokens) and REST (the rest's config)."""
    if m <= 16 or n % 8:
        return None
    if n * k < 2**22:
        return _small_layer_config(m, n, k, sms)
    if n * k < 2**24:
        return _mid_layer_config(m, n, k, sms)
    return layer_config(m, n, k, sms)


def layer_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """pick_config's config for a layer of 2^22 weights or more, past its guards (which
    layers take the GEMM at all): the token tile, K split and x ring, or None where K does
    not fit. bench/nvfp4_route_sweep.py times it on the layers the guards send elsewhere."""
    head = whole_tiles_first(m, n, sms)
    if head:
        first, rest = layer_config(head, n, k, sms), layer_config(m - head, n, k, sms)
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
        # (the split's sum costs the rest). K of 4096 and tiles that save no wave stay whole.
        cfg["SPLIT_K"] = 2
    if bm == 256 or tiles * cfg["SPLIT_K"] <= sms:
        # One program per SM: x slots of two steps, three of them (half the x barrier
        # traffic, six steps of x in flight); smaller tiles leave room for a fourth slot.
        # Two programs per SM cannot hold the larger ring. And the MMA warpgroup reads
        # each step ahead (_mma_partition's LOOKAHEAD).
        cfg.update(X_STEPS=2, STAGES=3 if bm == 256 else 4, LOOKAHEAD=True)
    return cfg


def first_slots_early(k_steps: int) -> bool:
    """Whether the kernel's prologue issues the first weight and x slots itself
    (gemm_kernel._first_slots) for a program of k_steps 64-wide K steps: where the loop is
    short, the loaders' own first issue starts the first DRAM latency too late; long loops
    (8192 x 28672: 224-448 steps) measure slower with it, so they keep the loaders' issue."""
    return k_steps <= 128


def whole_tiles_first(m: int, n: int, sms: int) -> int:
    """The tokens of a first launch in whole 256-token tiles (gemm_kernel.launch runs the rest
    in the config picked for them), or 0 for one launch. Where M leaves 17-128 tokens past
    whole tiles and their row of 256-token tiles (one program an SM) would add a wave to
    the launch, the rest's own config (tiles of up to 128 tokens, two programs an SM) takes
    less. Where the whole tiles take as many waves as all of them, two launches lose or
    tie, and so do 129 tokens or more past (the rest in 256-token tiles again)."""
    rest, rows = m % 256, cdiv(n, 64)
    if m < 256 or not 16 < rest <= 128:
        return 0
    fewer_waves = cdiv(rows * (m // 256), sms) < cdiv(rows * cdiv(m, 256), sms)
    return m - rest if fewer_waves else 0


def _small_layer_config(m: int, n: int, k: int, sms: int) -> dict | None:
    """Layers under 2^22 weights come here only where small_kernel and small_phased_kernel
    decline them (the route asks them first): K past small_configs.MAX_K, as SmolLM2's
    down projection (576 x 1536), at token counts past small_phased_kernel's one wave.
    Weight slots of 8 steps, two-step x slots read ahead, token tiles by count: 129-256
    tokens 32 (two programs per SM; at 128 tokens and fewer the Triton kernel is faster);
    more (prompts) 64 while the tiles fit in one wave, else 128."""
    if m <= 128:
        return None
    bm = 32 if m <= 256 else 64 if cdiv(n, 64) * cdiv(m, 64) <= sms else 128
    cfg = dict(BN=64, BM=bm, BK=64, G=8 if k % 512 == 0 else 4, STAGES=4, W_STAGES=2,
               SPLIT_K=1, maxnreg=128, X_STEPS=2, LOOKAHEAD=True)
    return cfg if fits(m, k, cfg) else None


# Mid-sized layers' prompt chunks (this many tokens and more) take routing's dequantize
# route, so _mid_layer_config declines them.
MID_LAYER_FROM = 256


def _mid_layer_config(m: int, n: int, k: int, sms: int) -> dict | None:
    """Layers of 2^22 to 2^24 weights (Llama-3.2-1B's q/k/v, 3072 x 2048, and o, 2048 x
    2048) at decode batches of 17-255 tokens; prompt chunks (MID_LAYER_FROM and more) take
    the dequantize route. These layers make few 64-row tiles, so the token tile is the
    largest that still gives about two thirds of the SMs a tile, at least 16, and K stays
    whole (the split's sum costs more than its spread gains). On one H100, 3072 x 2048 at
    32 / 64 / 128 tokens: 7.7 / 8.1 / 8.6 us, against 7.8-10.5 us in the large-layer
    config's bigger tiles and K splits, 20 us and up for the Triton kernel and 11-12 us
    for dequantize + cuBLAS."""
    if m >= MID_LAYER_FROM:
        return None
    rows = cdiv(n, 64)
    bm = next((b for b in (128, 64, 32) if b < 2 * m and 3 * rows * cdiv(m, b) >= 2 * sms), 16)
    cfg = dict(BN=64, BM=bm, BK=64, G=4, STAGES=4, W_STAGES=2, SPLIT_K=1, maxnreg=128)
    if rows * cdiv(m, bm) <= sms:  # one program an SM: layer_config's larger x ring
        cfg.update(X_STEPS=2, LOOKAHEAD=True)
    return cfg if fits(m, k, cfg) else None


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether each K split is whole weight slots (G steps of BK)."""
    return k % (cfg["G"] * cfg["BK"] * cfg.get("SPLIT_K", 1)) == 0


def needs_pad(m: int, cfg: dict) -> bool:
    """Whether gemm_kernel.launch copies x into whole token tiles first: under one tile of
    128 or 256 tokens, where x boxes reaching past M (TMA fills them with zeros) are slow;
    smaller tiles read past M as they are. Past one tile, the last tile moves back to end
    at M instead (shifts), which also saves the copy."""
    if "REST" in cfg:
        return needs_pad(m - cfg["HEAD"], cfg["REST"])
    return bool(m < cfg["BM"] and cfg["BM"] >= 128)


def shifts(m: int, cfg: dict) -> bool:
    """Whether the last token tile starts at M - BM (M past one tile, not whole tiles)."""
    return shifts_last_tile(m, cfg["BM"])


def head_config(cfg: dict) -> dict:
    """The first launch's config of a HEAD / REST pair (whole_tiles_first)."""
    return {key: v for key, v in cfg.items() if key not in ("HEAD", "REST")}
