"""NVFP4 weight-only linear for many tokens in Gluon: Hopper's wgmma fed from registers.

At a few hundred tokens the linear is tensor-core work. The Triton kernel (triton_kernel.py)
runs at about half of torch's bf16 matmul there: Triton can only issue a wgmma whose
register operand it then waits for, so decode and MMA take turns. Here (Gluon's
warp_specialize, 6 warps) they overlap:

- an x loader warp brings x tiles [BM tokens, BK] into the x ring by TMA, one or two steps
  per slot (two halve the barrier traffic where the ring can be that deep);
- a weight loader warp brings G steps of packed words [BN, G * BK / 8] (int32) and their
  block scales [BN, G * BK / 32] (int16 pairs) into one weight slot by TMA;
- one MMA warpgroup decodes each step's 64 x 64 weights straight into registers laid out
  as wgmma's A operand (gemm_fragment.py: thread t of a quad decodes byte t of each word,
  which is exactly the A fragment's K pairs), issues an asynchronous wgmma against the x
  tile in shared memory ("swap AB": the accumulator is [BN rows, BM tokens]) and decodes
  the next step while it runs. A step's registers stay live until its wgmma is known done.
  Where it runs alone on its SM it also reads each step a step ahead and shares the scale
  conversions across each quad (LOOKAHEAD);
- the output leaves by TMA through a free x slot; split K, where the tiles alone would
  leave SMs idle, sums the partials in a fixed order (deterministic);
- where a program's loop is short, the prologue issues the first weight and x slots
  itself, before the partitions start (gemm_configs.first_slots_early).

Every ring slot has a `ready` and an `empty` mbarrier; the weight loader fences before a
TMA overwrites a slot whose words were read by the MMA warpgroup's generic loads.

Tiles of up to 128 tokens fit in 128 registers a thread, so two programs share an SM and
one decodes while the other's wgmmas run; 256-token tiles hold a 128-register accumulator
and run one per SM. Where M is not whole tiles, the last tile moves back to end at M (the
rows it shares with the tile before are computed and stored twice, with the same values),
so no x box reaches past M; and where a few tokens past whole 256-token tiles would take a
wave of their own, they run as a second launch in their own config. Which config a call
gets, and those two rules, are plain host code in gemm_configs.py.

What bounds a step on 4096 x 4096 is the one MMA warp per scheduler issuing the decode
(135 instructions a step), not the 256 cycles of its wgmmas nor L2; on the large layers
it is mostly the x tile: 32 KB per step from L2, read once more by wgmma.

Numerics equal triton_kernel's (same exact decoded weights, fp32 accumulation, s2 and the
power of two in the epilogue).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..split_counters import tile_counters
from .common import DECODE, split_workspace
from .gemm_configs import first_slots_early, fits, head_config, needs_pad, shifts
from .gemm_fragment import acc_layout, decode_fragment, quads, read_step
from .grid import cdiv
from .launch_cache import Launch, LaunchCache


@gluon.jit
def _mma_partition(w_ring, s_ring, w_ready, w_empty, x_bufs, ready, empty, k_steps,
                   LOOKAHEAD: gl.constexpr):
    """The MMA warpgroup: per step, the weights from the weight slot into A registers, one
    asynchronous wgmma, at most one left in flight; an x slot (XG steps) is free once the
    wgmma of its last step is done, the weight slot once its last step is read.

    With LOOKAHEAD (one program per SM) each step's words and scales are read from shared
    memory, and the scales converted, before the previous step's decode, which then hides
    their latency; the quad shares the scale conversions (read_step). The slot's first step
    is read only after the previous slot's last: read earlier, the wait for the slot would
    hold up that step's wgmma instead of running beside it. Where two programs share an SM, the
    other program hides that latency and LOOKAHEAD costs more than it brings."""
    S: gl.constexpr = ready.shape[0]
    XG: gl.constexpr = x_bufs.shape[0] // S  # steps per x slot
    BM: gl.constexpr = x_bufs.shape[1]
    BK: gl.constexpr = x_bufs.shape[2]
    BN: gl.constexpr = w_ring.shape[1]
    WS: gl.constexpr = w_ring.shape[0]
    G: gl.constexpr = w_ring.shape[2] // (BK // 8)  # steps per weight slot
    ACC: gl.constexpr = acc_layout(BM)
    L3: gl.constexpr = quads(BK // 8)  # words
    L3P: gl.constexpr = quads(BK // 32)  # scale pairs
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    dtype: gl.constexpr = x_bufs.dtype
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    a_prev = gl.zeros([BN, BK], dtype, A_L)
    # At least one slot (fits()): without a zero-trip path ptxas keeps the wgmmas
    # pipelined (a path that zeroes acc between them makes it serialize all, C7515).
    gl.assume(k_steps >= G)
    for g in range(k_steps // G):
        wslot = g % WS
        mbarrier.wait(w_ready.index(wslot), (g // WS) & 1)
        if LOOKAHEAD:
            words, sc = read_step(w_ring.index(wslot), s_ring.index(wslot), 0, dtype, True,
                                  L3, L3P)
        for j in gl.static_range(G):
            i = g * G + j
            if not LOOKAHEAD:
                words, sc = read_step(w_ring.index(wslot), s_ring.index(wslot), j, dtype,
                                      False, L3, L3P)
            elif j + 1 < G:
                next_words, next_sc = read_step(w_ring.index(wslot), s_ring.index(wslot),
                                                j + 1, dtype, True, L3, L3P)
            if j == G - 1:  # every step of the slot is read
                mbarrier.arrive(w_empty.index(wslot), count=1)
            a = decode_fragment(words, sc, dtype, L3, A_L)
            xs = i // XG  # x slot number (G is a multiple of XG: j % XG is i % XG)
            if j % XG == 0:
                mbarrier.wait(ready.index(xs % S), (xs // S) & 1)
            acc = warpgroup_mma(a, x_bufs.index(xs % S * XG + j % XG).permute((1, 0)), acc,
                                is_async=True)
            acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
            if j % XG == 0:  # the previous slot's last wgmma is done
                mbarrier.arrive(empty.index((xs + S - 1) % S), count=1, pred=xs > 0)
            a_prev = a
            if LOOKAHEAD and j + 1 < G:
                words = next_words
                sc = next_sc
    return (warpgroup_mma_wait(0, deps=(acc,)),)  # (warp_specialize flattens a tuple)


@gluon.jit
def _load_weight_slot(w_desc, s_desc, w_ring, s_ring, w_ready, wslot, off_n, slot):
    """Weight slot `slot` of the row (G steps: packed words and block scales) into ring slot
    wslot by TMA, arriving on w_ready[wslot]."""
    GW: gl.constexpr = w_ring.shape[2]  # words per row and slot
    GP: gl.constexpr = s_ring.shape[2]  # scale pairs per row and slot
    mbarrier.expect(w_ready.index(wslot), w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(w_desc, [off_n, slot * GW], w_ready.index(wslot),
                                    w_ring.index(wslot))
    tma.async_copy_global_to_shared(s_desc, [off_n, slot * GP], w_ready.index(wslot),
                                    s_ring.index(wslot))


@gluon.jit
def _load_x_slot(x_desc, x_bufs, ready, slot, off_m, step):
    """x's K steps step .. step + XG - 1 into x slot `slot` by TMA, arriving on ready[slot]
    (rows past M arrive as zeros)."""
    XG: gl.constexpr = x_bufs.shape[0] // ready.shape[0]
    BK: gl.constexpr = x_bufs.shape[2]
    mbarrier.expect(ready.index(slot), XG * x_desc.block_type.nbytes)
    for j in gl.static_range(XG):
        tma.async_copy_global_to_shared(x_desc, [off_m, (step + j) * BK], ready.index(slot),
                                        x_bufs.index(slot * XG + j))


@gluon.jit
def _weight_load_partition(w_desc, s_desc, w_ring, s_ring, w_ready, w_empty, off_n,
                           slot_first, k_slots, PRE: gl.constexpr):
    """Weight loader warp: slots slot_first + PRE .. slot_first + k_slots - 1 of the row
    (rows past N arrive as zeros and are never stored; with PRE the prologue issued the
    first)."""
    WS: gl.constexpr = w_ring.shape[0]
    for g in range(PRE, k_slots):
        wslot = g % WS
        mbarrier.wait(w_empty.index(wslot), ((g // WS) & 1) ^ 1)
        fence_async_shared()  # the MMA warps' generic reads before the TMA overwrite
        _load_weight_slot(w_desc, s_desc, w_ring, s_ring, w_ready, wslot, off_n,
                          slot_first + g)


@gluon.jit
def _x_load_partition(x_desc, x_bufs, ready, empty, off_m, k_first, k_steps,
                      PRE: gl.constexpr):
    """x loader warp: x tiles into the x ring, XG steps per slot, from slot PRE on (with
    PRE the prologue issued the first)."""
    S: gl.constexpr = ready.shape[0]
    XG: gl.constexpr = x_bufs.shape[0] // S
    for xs in range(PRE, k_steps // XG):
        slot = xs % S
        mbarrier.wait(empty.index(slot), ((xs // S) & 1) ^ 1)
        _load_x_slot(x_desc, x_bufs, ready, slot, off_m, k_first + xs * XG)


@gluon.jit
def _first_slots(w_desc, s_desc, x_desc, w_ring, s_ring, x_bufs, w_ready, ready, off_n, off_m,
                 k_first):
    """Issue the first weight slot and the first x slot by TMA, from the prologue: the
    loader partitions get to theirs only after the barriers' setup and warp_specialize's
    start, and the first weights' DRAM latency would start that much later."""
    G: gl.constexpr = w_ring.shape[2] // (x_bufs.shape[2] // 8)  # steps per weight slot
    _load_weight_slot(w_desc, s_desc, w_ring, s_ring, w_ready, 0, off_n, k_first // G)
    _load_x_slot(x_desc, x_bufs, ready, 0, off_m, k_first)


@gluon.jit
def _epilogue(acc, c_smem, out_desc, s2_ptr, bias_ptr, N, off_n, off_m, HAS_BIAS: gl.constexpr,
              OUT_LOG2: gl.constexpr, ACC: gl.constexpr):
    """acc [BN rows, BM tokens] -> out[off_m:, off_n:] by TMA through c_smem, an x slot
    (all are free by now, and BN == BK gives it the output tile's shape and swizzle):
    whole 128-byte rows instead of scattered 2-byte stores; TMA drops rows and columns
    past M and N."""
    BN: gl.constexpr = acc.shape[0]
    y = (acc * (2.0**OUT_LOG2)) * gl.load(s2_ptr)  # the power of two is exact
    if HAS_BIAS:
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
        y += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    c_smem.store(gl.permute(y.to(c_smem.dtype), (1, 0)))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def _split_k_finish(acc, c_smem, out_desc, s2_ptr, bias_ptr, ws_ptr, cnt_ptr, N, off_n, off_m,
                    HAS_BIAS: gl.constexpr, OUT_LOG2: gl.constexpr, SPLIT_K: gl.constexpr,
                    ACC: gl.constexpr):
    """Sum the tile's SPLIT_K partials in split order (deterministic) and store them. cnt_ptr
    holds two counters per tile, both left at zero again: arrivals, and partials published.
    Every program but the last to arrive publishes its partial; the last one waits for
    them (they are all running by then) and sums. With two splits it adds the other's
    partial to its own registers (fp32 addition commutes, so the order cannot matter):
    one partial crosses memory instead of two written and two read back."""
    BN: gl.constexpr = acc.shape[0]
    BM: gl.constexpr = acc.shape[1]
    pid_k = gl.program_id(2)
    tile = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    n_tiles = gl.num_programs(0) * gl.num_programs(1)
    offs = (gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))[:, None] * BM
            + gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))[None, :])
    arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if (SPLIT_K > 2) | (not last):
        gl.store(ws_ptr + (pid_k * n_tiles + tile) * (BN * BM) + offs, acc)
        gl.thread_barrier()
        gl.atomic_add(cnt_ptr + n_tiles + tile, 1, sem="release", scope="gpu")
    if last:
        published = gl.atomic_add(cnt_ptr + n_tiles + tile, 0, sem="acquire", scope="gpu")
        while published < SPLIT_K - (SPLIT_K == 2):
            published = gl.atomic_add(cnt_ptr + n_tiles + tile, 0, sem="acquire", scope="gpu")
        if SPLIT_K == 2:
            total = acc + gl.load(ws_ptr + ((1 - pid_k) * n_tiles + tile) * (BN * BM) + offs,
                                  cache_modifier=".cg")  # L2: written by another SM
        else:
            total = gl.zeros([BN, BM], gl.float32, ACC)
            for sp in range(SPLIT_K):
                total += gl.load(ws_ptr + (sp * n_tiles + tile) * (BN * BM) + offs,
                                 cache_modifier=".cg")
        _epilogue(total, c_smem, out_desc, s2_ptr, bias_ptr, N, off_n, off_m,
                  HAS_BIAS, OUT_LOG2, ACC)
        # ready for the next launch (kernel order sequences it): relaxed, no fence
        gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(cnt_ptr + n_tiles + tile, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _gemm_kernel(
    x_desc, w_desc, s_desc, out_desc, s2_ptr, bias_ptr, ws_ptr, cnt_ptr, N,
    k_steps,  # BK steps per split: K // (BK * SPLIT_K)
    M,
    HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, X_STEPS: gl.constexpr,
    W_STAGES: gl.constexpr, OUT_LOG2: gl.constexpr, SPLIT_K: gl.constexpr,
    LOOKAHEAD: gl.constexpr, SHIFT: gl.constexpr, PRE: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    G: gl.constexpr = w_desc.block_type.shape[1] // (BK // 8)  # steps per weight slot
    gl.static_assert(BN == BK)  # the epilogue reuses an x slot for the output tile
    gl.static_assert(G % X_STEPS == 0)  # x slots never straddle weight slots
    # With one x slot the loader would wait for its release, which the MMA warpgroup
    # gives only after waiting for the loader's next fill.
    gl.static_assert(STAGES >= 2)
    ACC: gl.constexpr = acc_layout(BM)
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    if SHIFT:  # the last tile ends at M: no x box past M (its first rows are stored twice)
        off_m = gl.minimum(off_m, M - BM)
    k_first = gl.program_id(2) * k_steps
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES * X_STEPS, BM, BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(gl.int32, [W_STAGES] + w_desc.block_type.shape,
                                       w_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.int16, [W_STAGES] + s_desc.block_type.shape,
                                       s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)
    fence_async_shared()
    if PRE:
        _first_slots(w_desc, s_desc, x_desc, w_ring, s_ring, x_bufs, w_ready, ready, off_n,
                     off_m, k_first)
    (acc,) = gl.warp_specialize([
        (_mma_partition, (w_ring, s_ring, w_ready, w_empty, x_bufs, ready, empty, k_steps,
                          LOOKAHEAD)),
        (_x_load_partition, (x_desc, x_bufs, ready, empty, off_m, k_first, k_steps, PRE)),
        (_weight_load_partition, (w_desc, s_desc, w_ring, s_ring, w_ready, w_empty, off_n,
                                  k_first // G, k_steps // G, PRE)),
    ], [1, 1], [24, 24])
    if SPLIT_K == 1:
        _epilogue(acc, x_bufs.index(0), out_desc, s2_ptr, bias_ptr, N, off_n, off_m,
                  HAS_BIAS, OUT_LOG2, ACC)
    else:
        _split_k_finish(acc, x_bufs.index(0), out_desc, s2_ptr, bias_ptr, ws_ptr, cnt_ptr, N,
                        off_n, off_m, HAS_BIAS, OUT_LOG2, SPLIT_K, ACC)


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias) with cfg = dict(BN, BM, BK, G, STAGES (x
    slots), W_STAGES, SPLIT_K, maxnreg and optionally X_STEPS (steps per x slot, default
    1) and LOOKAHEAD: gemm_configs.pick_config's), or such a config with HEAD and REST
    (gemm_configs.whole_tiles_first): two launches; requires fits() and x, the packed
    weights, their scales and out all TMA-readable (common.tma_ready)."""
    m, k = x2.shape
    if "REST" in cfg:
        h = cfg["HEAD"]
        launch(x2[:h], packed, scales, s2, bias, out[:h], head_config(cfg))
        launch(x2[h:], packed, scales, s2, bias, out[h:], cfg["REST"])
        return out
    if needs_pad(m, cfg):
        # Whole token tiles: x boxes reaching past M (TMA fills them with zeros) are slow in
        # 128- and 256-token tiles (gemm_configs.needs_pad). The pad rows' outputs are never
        # stored: they need no values.
        padded = x2.new_empty(cdiv(m, cfg["BM"]) * cfg["BM"], k)
        padded[:m].copy_(x2)
        x2 = padded
    grid, args, constexprs, options, _, _ = _call(x2, packed, scales, s2, bias, out, cfg,
                                                  shared_ws=False)
    _LAUNCHES(grid, args, constexprs, options)
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment: each call makes x's and out's TMA descriptors. Not for calls that pad
    x (needs_pad). Its split-K workspace and counters are the current stream's, so the
    caller keeps one Launch a stream."""
    if "REST" in cfg:
        h = cfg["HEAD"]
        return _Halves(h, x2.shape, out.shape,
                       bind(x2[:h], packed, scales, s2, bias, out[:h], head_config(cfg)),
                       bind(x2[h:], packed, scales, s2, bias, out[h:], cfg["REST"]))
    grid, args, constexprs, options, make_x, make_out = _call(
        x2, packed, scales, s2, bias, out, cfg, shared_ws=True)
    return _LAUNCHES.bind(grid, args, constexprs, options, None, args[0], args[3], make_x,
                          make_out)


class _Halves:
    """Two bound launches, on x's and out's first `head` rows and on the rest, called as
    one Launch."""

    def __init__(self, head: int, x_shape, out_shape, first: Launch, rest: Launch) -> None:
        self.head, self.x_shape, self.out_shape = head, tuple(x_shape), tuple(out_shape)
        self.first, self.rest = first, rest

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        x2, out2, h = x.view(self.x_shape), out.view(self.out_shape), self.head
        self.first(x2[:h], out2[:h])
        self.rest(x2[h:], out2[h:])


def _call(x2, packed, scales, s2, bias, out, cfg, shared_ws: bool) -> tuple:
    """(grid, runtime args, constexprs, options, x -> its descriptor, out -> its
    descriptor) of one launch on an x2 that needs no padding."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, bm, bk, g = (cfg[key] for key in ("BN", "BM", "BK", "G"))
    assert fits(m, k, cfg) and bn == bk == 64 and not needs_pad(m, cfg), (m, k, cfg)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_shape, out_shape = tuple(x2.shape), tuple(out.shape)

    def make_x(x: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(x.view(x_shape), [bm, bk], layout)

    def make_out(y: torch.Tensor) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(y.view(out_shape), [bm, bn], layout)

    # Weight slots: G steps' [BN, G * BK / 8] int32 words, 128-byte swizzled so that the
    # eight rows a warp reads at once fall in different banks; and their [BN, G * BK / 32]
    # int16 scale pairs (16-byte rows at G = 4: a TMA box's minimum).
    words = packed.view(torch.int32)
    pairs = scales.view(torch.int16)
    w_desc = TensorDescriptor.from_tensor(words, [bn, g * bk // 8], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=32, rank=2))
    s_desc = TensorDescriptor.from_tensor(pairs, [bn, g * bk // 32], gl.NVMMASharedLayout(
        swizzle_byte_width=0, element_bitwidth=16, rank=2))
    split = cfg.get("SPLIT_K", 1)
    grid = (cdiv(n, bn), cdiv(m, bm), split)
    if split > 1:
        tiles = grid[0] * grid[1]
        ws = split_workspace(x2.device, split * tiles * bn * bm, shared_ws)
        cnt = tile_counters(x2.device, 2 * tiles)
    else:
        ws = cnt = s2  # never read
    # s2 stands in for a missing bias (never read), so a bound launch keeps no output
    return (
        grid,
        (make_x(x2), w_desc, s_desc, make_out(out), s2, bias if bias is not None else s2,
         ws, cnt, n, k // (bk * split), m),
        dict(HAS_BIAS=bias is not None, STAGES=cfg["STAGES"], X_STEPS=cfg.get("X_STEPS", 1),
             W_STAGES=cfg["W_STAGES"], OUT_LOG2=DECODE[x2.dtype][1], SPLIT_K=split,
             LOOKAHEAD=cfg.get("LOOKAHEAD", False), SHIFT=shifts(m, cfg),
             PRE=int(first_slots_early(k // (bk * split)))),  # an int: loops start at it
        # 6 warps (4 + two loaders), launched as 8: 232 registers -> 59.4K, one program
        # per SM; 128 -> two
        dict(num_warps=4, maxnreg=cfg["maxnreg"]),
        make_x, make_out,
    )


_LAUNCHES = LaunchCache(_gemm_kernel)  # a memo of compiled launches, as Triton's own cache
