"""NVFP4 weight-only linear for small layers in Gluon: decode once into shared memory,
then wgmma from there (small_form.py describes the form).

The routing table (routing.py) sends it layers of under 2^22 weights with K a multiple of
64 up to small_configs.MAX_K (SmolLM2's 576-wide layers). Those are latency-bound: torch
runs 576 x 576 at 256 tokens in about three times an empty launch. The Triton kernel is
one chain per program of K steps, each a decode in registers and a wgmma it must wait
for. Here a program takes 64 tokens (128 on two warpgroups) and 16 to 64 weight rows over
the whole K:

- every load of the program (the weight words and block scales of all K, s2 and the
  bias, and its x tile by TMA) is issued at once, so it pays one memory latency;
- its weights are decoded once into shared memory (small_form.decode_to_shared);
- one barrier, then every wgmma is issued back to back, x as the A operand (the tokens
  are the MMA's M) and the decoded weights as B, and waited for once;
- the epilogue stores 16 bytes a thread, whole 32-byte sectors (small_form.store_tokens'
  WIDE).

Up to 32 tokens (X_REGS) x skips shared memory: each thread loads its A fragment straight
from global memory, two 16-byte loads per token row and chunk, and the wgmmas read only
the weights from shared memory. The fragment pairs K as (2q, 2q + 1, 2q + 8, 2q + 9) per
16-wide step, q = lane % 4; K is reordered inside each 64-wide chunk, identically for x
and the decoded weights (a sum does not care about the order of its terms), so that a
thread's fragment over the chunk's four steps is memory K 16q .. 16q + 15 (see
_x_to_registers). The TMA form fills a 64-token tile for even one token and the MMA
reads it all, where this form loads only the rows below M; from about 40 tokens the TMA
form is faster. Past one tile, where M is not whole tiles, the last tile moves back to
end at M, so no box runs past M (small_form.tile_row0). An x that TMA cannot read (a
misaligned view) goes to the Triton kernel past 32 tokens.

Longer K (SmolLM2's down projection, K = 1536) does not fit x's tile in shared memory:
small_phased_kernel streams it through a ring.

Numerics equal triton_kernel's (the same exact decoded weights, fp32 accumulation, s2 and
the power of two in the epilogue).
"""

import functools

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

from .common import DECODE, tma_ready
from .grid import cdiv, shifts_last_tile
from .launch_cache import Launch, LaunchCache
from .small_configs import fits
from .small_form import (
    decode_to_shared,
    layouts,
    load_rows,
    store_tokens,
    tile_row0,
    wide_stores,
    words_asm,
)


@functools.cache  # one object per config: the launcher keys its compiled kernels on it
def x_layout(num_warps: int):
    """x's register layout for X_REGS, over [tokens / 16, 2, 8, 4, 16]: thread (warp w, lane
    t) holds token rows 16 w + 8 h + t / 4 (h = 0, 1) and memory K 16 q .. 16 q + 15 of each
    chunk, q = t % 4: the rows and the K columns of its wgmma A fragment."""
    return gl.BlockedLayout([1, 2, 1, 1, 16], [1, 1, 8, 4, 1], [num_warps, 1, 1, 1, 1],
                            [4, 3, 2, 1, 0])


@gluon.jit
def _x_to_registers(x_ptr, stride_xm, row0, M, KC: gl.constexpr, BM: gl.constexpr,
                    XL: gl.constexpr, AL: gl.constexpr):
    """x [row0, row0 + BM) x all K as KC wgmma A fragments in register_k_order (rows past M
    are zeros and not read): the loads are in memory order, and the reorder only renames
    registers (the compiler checks that: assert_trivial)."""
    l0: gl.constexpr = gl.SliceLayout(
        1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l1: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l2: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, XL))))
    l3: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, XL))))
    l4: gl.constexpr = gl.SliceLayout(
        0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    warp = gl.arange(0, BM // 16, layout=l0)[:, None, None, None, None]
    half = gl.arange(0, 2, layout=l1)[None, :, None, None, None]
    lane_row = gl.arange(0, 8, layout=l2)[None, None, :, None, None]
    q = gl.arange(0, 4, layout=l3)[None, None, None, :, None]
    e = gl.arange(0, 16, layout=l4)[None, None, None, None, :]
    rows = row0 + 16 * warp + 8 * half + lane_row
    ptrs = x_ptr + rows.to(gl.int64) * stride_xm + (16 * q + e)
    mask = (rows < M) & (e >= 0)  # e >= 0 only broadcasts the mask to the pointers' shape
    chunks = ()
    for c in gl.static_range(KC):  # every load in flight before the first is used
        chunks = chunks + (gl.load(ptrs + c * 64, mask=mask, other=0.0),)
    xa = ()
    for c in gl.static_range(KC):
        t = gl.reshape(chunks[c], [BM // 16, 2, 8, 4, 4, 2, 2])  # e = (s, h, pair element)
        t = gl.reshape(gl.permute(t, (0, 1, 2, 4, 5, 3, 6)), [BM, 64])
        xa = xa + (gl.convert_layout(t, AL, assert_trivial=True),)
    return xa


@gluon.jit
def _x_by_tma(x_desc, row, KC: gl.constexpr, SW: gl.constexpr):
    """Start TMA copies of the x tile [BM, 64 KC] (rows past M arrive as zeros) into one
    shared buffer per chunk; returns (the buffers, the barrier that says they arrived)."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [KC] + x_desc.block_type.shape, SW)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(bar.index(0), KC * x_desc.block_type.nbytes)
    for c in gl.static_range(KC):
        tma.async_copy_global_to_shared(x_desc, [row, c * 64], bar.index(0), x_smem.index(c))
    return x_smem, bar


@gluon.jit
def _small_kernel(
    x_src, w_ptr, s_ptr, s2_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_w, stride_s, stride_om,  # w in int32 words, s in bytes
    HAS_BIAS: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, KC: gl.constexpr,
    OUT_LOG2: gl.constexpr, WL: gl.constexpr, ACC: gl.constexpr, SW: gl.constexpr,
    X_REGS: gl.constexpr, XL: gl.constexpr, WIDE: gl.constexpr, WORDS_ASM: gl.constexpr,
    SHIFT: gl.constexpr,
):
    """out[tokens, rows] for BM tokens (64 a warpgroup: wgmma's A, from x_src, a TMA
    descriptor whose rows past M arrive as zeros, or for X_REGS x's pointer, loaded into
    registers) and BN weight rows (decoded into shared memory: wgmma's B) over the whole
    K; the store writes each token's rows contiguously."""
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    words, scales, out_rows, s2, bias = load_rows(
        w_ptr, s_ptr, s2_ptr, bias_ptr, pid_n, N, stride_w, stride_s, HAS_BIAS, BN, KC, WL, ACC,
        WORDS_ASM)
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    row0 = tile_row0(pid_m, M, BM, SHIFT)  # SHIFT with x by TMA only (the host sets it so)
    if X_REGS:
        dtype: gl.constexpr = x_src.dtype.element_ty
        AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        xa = _x_to_registers(x_src, stride_xm, row0, M, KC, BM, XL, AL)
        w_bufs = decode_to_shared(words, scales, SW, dtype, True)
        for c in gl.static_range(KC):
            acc = warpgroup_mma(xa[c], w_bufs[c].permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,) + xa)[0]
    else:
        x_smem, x_bar = _x_by_tma(x_src, row0, KC, SW)
        w_bufs = decode_to_shared(words, scales, SW, x_src.dtype, False)
        mbarrier.wait(x_bar.index(0), 0)
        for c in gl.static_range(KC):
            acc = warpgroup_mma(x_smem.index(c), w_bufs[c].permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.invalidate(x_bar.index(0))
    store_tokens(acc, row0, pid_m * BM, out_rows, s2, bias, out_ptr, M, N, stride_om, HAS_BIAS,
                 OUT_LOG2, WIDE)


def launch(x2, packed, scales, s2, bias, out, cfg):
    """out [M, N] = x2 [M, K] @ W.T (+ bias), with cfg = dict(BN, num_warps, X_REGS=False);
    requires fits(M, K, cfg), packed readable as int32 words, x TMA-readable unless X_REGS,
    and unit strides along K."""
    grid, args, constexprs, options, key, _ = _call(x2, packed, scales, s2, bias, out, cfg)
    _LAUNCHES(grid, args, constexprs, options, key)
    return out


def bind(x2, packed, scales, s2, bias, out, cfg) -> Launch:
    """launch's call as a Launch taking (x, out) of x2's and out's shape, strides, dtype
    and alignment; in the TMA form each call makes x's descriptor (x may be given with
    leading dimensions: it is viewed as x2's shape)."""
    grid, args, constexprs, options, key, make_x = _call(x2, packed, scales, s2, bias, out,
                                                         cfg)
    return _LAUNCHES.bind(grid, args, constexprs, options, key, args[0], out, make_x)


def _call(x2, packed, scales, s2, bias, out, cfg) -> tuple:
    """(grid, runtime args, constexprs, options, static key, x -> its descriptor or None
    where x is passed as itself) of one launch."""
    m, k = x2.shape
    n = packed.shape[0]
    bn, w, x_regs = cfg["BN"], cfg["num_warps"], cfg.get("X_REGS", False)
    assert fits(m, k, cfg) and x2.stride(1) == 1 and packed.data_ptr() % 4 == 0, (m, k, cfg)
    assert bn in (16, 32, 64) and bn * 8 >= 32 * w, cfg  # at least a word a thread
    assert w == 4 or not x_regs, cfg  # X_REGS on one warpgroup: the form tested and picked
    bm = 16 * w  # 64 tokens a warpgroup
    wl, acc, sw = layouts(bn, w)
    if x_regs:
        make_x, xl = None, x_layout(w)
    else:
        assert tma_ready(x2), "x must be TMA-readable without X_REGS"
        shape = tuple(x2.shape)

        def make_x(x: torch.Tensor) -> TensorDescriptor:
            return TensorDescriptor.from_tensor(x.view(shape), [bm, 64], sw)

        xl = None
    x_src = x2 if make_x is None else make_x(x2)
    wide = not x_regs and wide_stores(n, out)
    shift = shifts_last_tile(m, bm) and not x_regs
    asm = words_asm(packed, wl)
    words = packed.view(torch.int32)
    has_bias = bias is not None
    return (
        (cdiv(n, bn), cdiv(m, bm)),
        (x_src, words, scales.view(torch.uint8), s2, bias if has_bias else out, out,
         m, n, x2.stride(0), words.stride(0), scales.stride(0), out.stride(0)),
        dict(HAS_BIAS=has_bias, BN=bn, BM=bm, KC=k // 64, OUT_LOG2=DECODE[x2.dtype][1],
             WL=wl, ACC=acc, SW=sw, X_REGS=x_regs, XL=xl, WIDE=wide, WORDS_ASM=asm,
             SHIFT=shift),
        dict(num_warps=w), (has_bias, bn, w, k, x2.dtype, x_regs, wide, asm, shift), make_x)


_LAUNCHES = LaunchCache(_small_kernel)  # a memo of compiled launches, as Triton's own cache
