"""Which kernel computes an NVFP4 linear y = x @ W.T: the routing table.

Plain Python on the product's shape, x's dtype and a few facts about the operands'
addresses (Operands), without Triton, so the table is tested everywhere
(tests/kernels/test_nvfp4_routing.py). linear.py asks it on every call it does not have a
plan for; prepared.py once per x signature.

W is [N, K] (N output rows, K inputs), x is [M, K]: M tokens. A small layer has fewer than
2^22 weights (SmolLM2-135M's are 576 x 576 to 3072 x 576 and 576 x 1536), a mid-sized one
2^22 to 2^24 (Llama-3.2-1B's q/k/v, 3072 x 2048, and o, 2048 x 2048), a large one 2^24 or
more (Llama-8B's 4096 x 4096 and up). The rows are tried in order; the first kernel whose
config function takes the call, and that can read the operands, runs it:

1. gemv (gemv_kernel.py): 1-8 tokens on layers of at least 2^22 weights, K a multiple of
   128. The weight stream is the whole cost; mma.sync on registers needs no barrier and
   no wait between K steps, where the Triton kernel's wgmma waits each step. 8192 x 28672
   at M = 1: ~39 us on an H200, against ~60 us for the Triton kernel and ~115 us for
   torch's bf16 GEMV; 2048 x 2048 on an H100: 3.5 us against 5.6 (Triton) and 6.3 (torch).
2. small (small_kernel.py): small layers with K a multiple of 64 up to
   small_configs.MAX_K (576: all of SmolLM2-135M's but the down projection), any token
   count. Latency-bound: every load of a program is issued at once, its weights decoded
   once into shared memory, its wgmmas issued back to back. SmolLM2's 576 x 576 runs in
   ~2.7 us at M = 1 and ~3.5 us at M = 256, under torch's bf16 (~3.6 / ~3.8 us).
3. small_phased (small_phased_kernel.py): small layers with longer K in whole 256-wide
   phases, past few_tokens (SmolLM2's down projection from 33 tokens), while the
   programs fit in one wave, and not long_and_light. x's tile does not fit in shared
   memory beside the decoded weights, so it streams through a ring: 576 x 1536 at 64-256
   tokens in ~5.0-5.1 us (torch ~5.1-5.2).
4. gemm (gemm_kernel.py): 17 tokens and more on large layers (N a multiple of 8, K of
   256), 17-255 tokens on mid-sized ones (decode batches), and small layers past 128
   tokens that rows 2-3 decline (SmolLM2's down projection from 449 tokens). Tensor-core
   work: a warp-specialized kernel whose MMA warpgroup decodes the next step while its
   wgmma runs. 8192 x 28672 at M = 256 in ~155 us (torch 171-175 us).
5. triton (triton_kernel.py): everything else: 9-16 tokens on large and mid-sized
   layers, few tokens on small layers with long K (few_tokens: SmolLM2's down projection
   up to 32 tokens), long_and_light, and operands the Gluon kernels cannot read
   (misaligned views). It takes any shape and alignment; at 9-16 tokens it streams the
   weights faster than the GEMV's two MMA columns or the GEMM.
Then the override, dequantize (linear.dequantize_linear): bf16 x on layers under 2^22
   weights, from the tokens and multiply-adds FROM names for the kernel rows 1-5 picked
   (small, gemm, triton). The kernels decode every weight once per token tile; for a long
   prompt, dequantizing once into a bf16 scratch weight (under 8 MB) and calling cuBLAS
   is faster, and its output is reference.linear's bit for bit. fp16 keeps the kernels:
   w * s2 rounded to fp16 can fall into its subnormals, where the kernels keep the
   weights exact. Mid-sized layers take the route from 256 tokens (prompt chunks, a
   scratch weight of at most 32 MB), never at decode batches: there the GEMV and the GEMM
   read 3.6x fewer bytes than the scratch weight written and read back.

x in fp32 never reaches the table: linear.py dequantizes to fp32 and calls torch's matmul
(the fp32 tensor cores would round x to tf32, and fp32 is not a serving dtype).

The Gluon kernels (rows 1-4) need CUDA tensors (Gluon has no CPU interpreter) and a
Triton with Gluon; each also needs to read its operands as it views them (Operands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import gemm_configs, gemv_configs, small_configs, small_phased_configs, triton_configs
from .common import tma_ready

GLUON_KERNELS = ("gemv", "small", "small_phased", "gemm")


@dataclass(frozen=True)
class Operands:
    """What the Gluon kernels need of the operands beyond their shapes."""

    cuda: bool  # x is a CUDA tensor
    weight_words: bool  # packed reads as int32 words: 4-byte aligned
    scale_pairs: bool  # scales read as int16 pairs: 2-byte aligned
    x_tma: bool  # x makes a TMA descriptor (common.tma_ready)
    others_tma: bool  # so do packed, scales and out


ALIGNED = Operands(cuda=True, weight_words=True, scale_pairs=True, x_tma=True, others_tma=True)


def operands(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
             out: torch.Tensor) -> Operands:
    """The Operands of out = x2 @ W.T, x2 [M, K] and out [M, N] 2-D."""
    return Operands(cuda=x2.is_cuda, weight_words=packed.data_ptr() % 4 == 0,
                    scale_pairs=scales.data_ptr() % 2 == 0, x_tma=tma_ready(x2),
                    others_tma=all(tma_ready(t) for t in (packed, scales, out)))


def route(m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132,
          ops: Operands = ALIGNED, gluon: tuple[str, ...] = GLUON_KERNELS) -> tuple[str, dict]:
    """(kernel, config) for an [m, k] x [n, k]^T product with x in `dtype` (bf16 or fp16)
    on a device of `sms` SMs: the module doc's table. `gluon` names the Gluon kernels this
    Triton can build. The kernel is "gemv", "small", "small_phased", "gemm", "triton" or
    "dequantize" (whose config is {})."""
    kernel, cfg = _kernel(m, n, k, sms, ops, gluon)
    if ops.cuda and takes_dequantize_route(kernel, m, n, k, dtype):
        return "dequantize", {}
    return kernel, cfg


def _kernel(m: int, n: int, k: int, sms: int, ops: Operands,
            gluon: tuple[str, ...]) -> tuple[str, dict]:
    """Rows 1-5 of the table, in order: the first kernel whose config function takes the
    call and that can read the operands."""
    if ops.cuda:
        # 1: few tokens on long rows
        if "gemv" in gluon and ops.weight_words and ops.scale_pairs:
            cfg = gemv_configs.pick_config(m, n, k, sms)
            if cfg:
                return "gemv", cfg
        # 2: small layers with short K (x by plain loads up to X_REGS_MAX_M tokens)
        if ("small" in gluon and ops.weight_words
                and (m <= small_configs.X_REGS_MAX_M or ops.x_tma)):
            cfg = small_configs.pick_config(m, n, k, sms)
            if cfg:
                return "small", cfg
        # 3: small layers with longer K
        if "small_phased" in gluon and ops.x_tma and ops.weight_words:
            cfg = small_phased_configs.pick_config(m, n, k, sms)
            if cfg:
                return "small_phased", cfg
        # 4: many tokens
        if "gemm" in gluon and ops.x_tma and ops.others_tma:
            cfg = gemm_configs.pick_config(m, n, k, sms)
            if cfg:
                return "gemm", cfg
    # 5: everything else
    return "triton", triton_configs.pick_config(m, n, k, sms)


# The override: layers under this many weights (a bf16 scratch weight under 8 MB). Past
# it, large layers keep the GEMM: dequantizing there gains little, only from 2048 tokens,
# for a scratch weight of tens of MB.
MAX_WEIGHTS = 1 << 22
# kernel -> (tokens, multiply-adds a call) from which dequantize + cuBLAS replace it. The
# GEMV (at most 8 tokens) and the phased kernel (up to 256 tokens, where dequantize is
# slower) keep their calls.
FROM = {"small": (512, 1 << 29), "gemm": (1024, 1 << 29), "triton": (32, 1 << 27)}
# Mid-sized layers (2^22 to 2^24 weights: Llama-3.2-1B's q/k/v and o) run the GEMV, the
# Triton kernel or the GEMM at decode batches (up to 128 in the decode graphs, 255 here);
# prompt chunks (gemm_configs.MID_LAYER_FROM, 256 tokens and up, the prefill's chunk)
# take dequantize + cuBLAS, so NVFP4 costs no TTFT.
MAX_MID_WEIGHTS = 1 << 24  # exclusive: from 2^24 the GEMM serves prompts


def takes_dequantize_route(kernel: str, m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether an [m, k] x [n, k]^T product that rows 1-5 gave `kernel` runs as
    dequantize + cuBLAS instead (the table's override)."""
    if dtype != torch.bfloat16:
        return False
    if MAX_WEIGHTS <= n * k < MAX_MID_WEIGHTS:
        return m >= gemm_configs.MID_LAYER_FROM
    min_tokens, min_macs = FROM.get(kernel, (math.inf, math.inf))
    return n * k < MAX_WEIGHTS and m >= min_tokens and m * n * k >= min_macs
