"""Which config gemv_kernel.py's GEMV runs a call with: whether a call fits a config (fits),
the tile, K split or K slices and x staging a call gets (pick_config), and the rules under
it (_split, _even_rows). Plain Python on ints and dicts, without Triton, so these rules are
tested everywhere (tests/kernels/test_nvfp4_routing.py).
"""

from .grid import cdiv

X_SMEM_CHUNKS = 64  # x staged per program: at most 16 KB of bf16 at 128 elements a chunk


def pick_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """The config for an [m, k] x [n, k]^T product, or None where another kernel runs:
    more than 8 tokens, layers under 2^22 weights, K not a multiple of 128.
    - one token on 2048 to 4096 rows with K up to 4096, or up to 8192 where the staged-x
      form below would split K fewer than 8 ways: K split across the warps of a program
      (SLICES), 8 warps where K makes 8 slices of four-chunk groups, else 4; 16 rows a
      program, or 32 from 3072 rows where each slice is one group (longer slices run
      slower at 32 rows). One in-program reduction replaces the split-K workspace;
    - other single tokens: x staged in shared memory (X_SMEM), 64 rows on 4 warps a
      program, K split until there are about four programs per SM, and fewer rows a
      program where that evens out the SMs (_even_rows);
    - two to 8 tokens: 128 rows on 8 warps per program (64 on 4 on layers under 2^24
      weights, whose 128-row tiles are too few) and K split until there are about two
      programs per SM; 16 tokens (two MMA columns of 8) would be slower than the Triton
      kernel, which takes them;
    - K in whole chunks of 128 but not whole four-chunk groups per split (RAGGED, e.g.
      Llama-2's 11008 = 86 chunks): uneven splits by the same rule, their last group
      partly masked."""
    if m > 8 or n * k < 2**22:
        return None
    return layer_config(m, n, k, sms)


def layer_config(m: int, n: int, k: int, sms: int = 132) -> dict | None:
    """pick_config's config for up to 8 tokens past its guard on the layer's size (which
    layers take the GEMV at all), or None where K does not fit: the rules of pick_config's
    docstring. bench/nvfp4_route_sweep.py times it on the layers the guard sends elsewhere."""
    if m == 1:
        staged = _split(dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, num_warps=4, X_SMEM=True),
                        m, n, k, 4 * sms)
        if staged is not None and not fits(m, k, staged):
            staged = None
        if 2048 <= n <= 4096 and k <= 8192 and (
                staged is None or k <= 4096 or staged["SPLIT_K"] < 8):
            for w in (8, 4):
                # 32 rows a program where that leaves 96 programs or more and each warp's
                # slice is one four-chunk group (longer slices run slower at 32 rows)
                rows = 32 if n >= 3072 and k == 4 * 128 * w else 16
                cfg = dict(BN=rows * w, BM=8, NBYTES=16, SPLIT_K=1, SLICES=w, num_warps=w)
                if fits(m, k, cfg):
                    return cfg
        if staged is not None:
            return _even_rows(staged, n, sms)
    if n * k < 2**24:  # Llama-3.2-1B's q/k/v and o: 2048 x 2048 at 4 tokens 4.9 us, not 5.5
        cfg = dict(BN=64, BM=8, NBYTES=16, SPLIT_K=1, num_warps=4)
    else:
        cfg = dict(BN=128, BM=8, NBYTES=16, SPLIT_K=1, num_warps=8)
    if not fits(m, k, cfg):
        cfg["RAGGED"] = True  # e.g. K = 11008, 86 chunks: uneven splits
        if not fits(m, k, cfg):
            return None
    return _split(cfg, m, n, k, 2 * sms)


def _even_rows(cfg: dict, n: int, sms: int) -> dict:
    """cfg with ROWS (fewer weight rows a program than its BN) where its grid puts four
    programs on some SMs and three on others: the grid then fills all four program slots
    of every SM with programs of fewer bytes each, so the busiest SMs read less. The spare
    rows are still decoded (and dropped), so where no SM had four programs this would add
    work, and the rule leaves those grids alone. Outputs are bit-equal (each output row's
    sum is the same)."""
    programs = cdiv(n, cfg["BN"]) * cfg["SPLIT_K"]
    if 3 * sms < programs < 4 * sms:
        rows = cdiv(n, 4 * sms // cfg["SPLIT_K"])
        if rows < cfg["BN"]:
            cfg["ROWS"] = rows
    return cfg


def _split(cfg: dict, m: int, n: int, k: int, programs: int) -> dict | None:
    """cfg with SPLIT_K doubled while the grid stays within `programs` and K still splits
    into whole four-chunk groups (or, RAGGED, four chunks a split); None where K does not
    fit cfg at all. X_SMEM's bound on chunks per split is left to the caller's fits()."""
    split_fits = dict(cfg, X_SMEM=False)  # the K rule alone; X_SMEM's bound is checked after
    if not fits(m, k, split_fits):
        return None
    tiles = cdiv(n, cfg["BN"])
    while tiles * cfg["SPLIT_K"] * 2 <= programs:
        if not fits(m, k, dict(split_fits, SPLIT_K=cfg["SPLIT_K"] * 2)):
            break
        cfg["SPLIT_K"] *= 2
    return cfg


def fits(m: int, k: int, cfg: dict) -> bool:
    """Whether the Gluon GEMV handles this call: few tokens (one where K is sliced across
    warps) and whole four-chunk groups per split or slice, or (RAGGED) whole chunks and at
    least four per split; X_SMEM: one token, neither sliced nor ragged, at most
    X_SMEM_CHUNKS chunks per split."""
    slices = cfg.get("SLICES", 1)
    chunk = 8 * cfg["NBYTES"]
    if cfg.get("X_SMEM") and (m != 1 or slices > 1 or cfg.get("RAGGED")
                              or k // (chunk * cfg["SPLIT_K"]) > X_SMEM_CHUNKS):
        return False
    if cfg.get("RAGGED"):
        return (slices == 1 and m <= cfg["BM"] and k % chunk == 0
                and k // chunk >= 4 * cfg["SPLIT_K"])
    return (m <= (1 if slices > 1 else cfg["BM"])
            and k % (4 * chunk * cfg["SPLIT_K"] * slices) == 0)
