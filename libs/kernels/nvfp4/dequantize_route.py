"""Which NVFP4 linears run as dequantize + cuBLAS: prompts on layers of up to 2^22 weights.

This is reference.linear's own computation (dequantize to x.dtype, then torch's matmul),
run on the GPU with the Triton dequantize, so its output equals the reference's bit for
bit. Plain host code, without Triton, so the rule is testable everywhere.

Why: linear_kernels' kernels decode every weight once per token tile, so at many tokens
they lose to cuBLAS on bf16 weights (SmolLM2's fused gate_up at 512-8192 tokens 1.9-2.3x
slower). Dequantizing once costs a few us and at most 8 MB of scratch here, which past some
length is less than what the kernels lose. Measured on one H200 (session `dequant-route` in
docs/notes/nvfp4-triton.md), dequantize + cuBLAS against the kernel the route picked, from
the tokens and multiply-adds a call FROM[kernel] names:
- the small kernel (SmolLM2's 576-wide layers): 1.03-2.25x faster; 0.83-0.99x just below
  (but 1.08x at 4096 tokens on 192x576);
- the GEMM (SmolLM2's down, 2048x1536): 1.06-1.57x from 1024 tokens; 0.82-0.96x at 512;
- the Triton kernel, which past 16 tokens runs where the Gluon kernels decline (2048x2048,
  4096x1024, 1024x4096 there): 1.4-2.4x from 32 tokens; 0.58-0.69x at 8-16 tokens.
The GEMV (at most 8 tokens) and the phased kernel (up to 256 tokens, where dequantize
ran 0.57-0.83x) keep their calls. Layers past 2^22 weights keep the GEMM: on 4096x4096
and Llama-8B's MLP it gained at most 11%, only from 2048 tokens, for a scratch weight of
32-117 MB. fp16 is left out: w * s2 rounded to fp16 can fall into its subnormals, where
the kernels keep the weights exact and apply s2 in fp32.
"""

import math

import torch

MAX_WEIGHTS = 1 << 22
# kernel -> (tokens, multiply-adds a call) from which dequantize + cuBLAS replace it
FROM = {"small": (512, 1 << 29), "gemm": (1024, 1 << 29), "triton": (32, 1 << 27)}


def takes_dequantize_route(kernel: str, m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether an [m, k] x [n, k]^T product that the route gave `kernel` runs as
    dequantize + cuBLAS instead (see the module doc)."""
    min_tokens, min_macs = FROM.get(kernel, (math.inf, math.inf))
    return (dtype == torch.bfloat16 and n * k <= MAX_WEIGHTS and m >= min_tokens
            and m * n * k >= min_macs)
