"""The fused layer kernels (libs/kernels/fused_layer.py) compile for Hopper (sm_90) here,
with no GPU: Triton's own compiler, down to a cubin through the ptxas its wheel carries.

The interpreter runs the kernels' arithmetic on the CPU but never compiles them, so a
kernel it accepts can still fail to compile on the card (a type or layout the compiler
rejects, a constexpr that does not fold). This compiles each kernel for every dtype a
member serves in and for the shapes of the models it serves, as the wrappers launch them.
"""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="under the interpreter @triton.jit is not compiled")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    HOPPER = GPUTarget("cuda", 90, 32)
    HAVE_BACKEND = "nvidia" in __import__("triton.backends").backends.backends
except ImportError:  # a Triton without the NVIDIA backend
    HAVE_BACKEND = False

DTYPES = ["bf16", "fp16", "fp32"]
# (dim, heads, kv heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Llama-3-8B, the tiny spec
SHAPES = [(576, 9, 3, 64), (2048, 32, 8, 64), (4096, 32, 8, 128), (64, 4, 2, 16)]


def compile_for_hopper(kernel, types: dict[str, str], constexprs: dict[str, object]):
    """Compile `kernel` with these argument types and constexpr values for sm_90."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(source, target=HOPPER)
    assert compiled.asm["cubin"], "no cubin"
    return compiled


@pytest.mark.skipif(not HAVE_BACKEND, reason="this Triton has no NVIDIA backend")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_layer_kernels_compile_for_hopper(dtype):
    from libs.kernels import fused_layer as fl

    ptr = f"*{dtype}"
    for dim, heads, kv_heads, head_dim in SHAPES:
        for add in (False, True):
            compile_for_hopper(
                fl._rms_norm_kernel,
                dict(x_ptr=ptr, delta_ptr=ptr, w_ptr=ptr, out_ptr=ptr, stride_x="i64",
                     stride_d="i64", stride_o="i64", n="i32", eps="fp32"),
                {"ADD": add, "BLOCK": triton.next_power_of_2(dim)})
        compile_for_hopper(
            fl._rope_kernel,
            dict(qkv_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr, q_ptr=ptr, k_ptr=ptr,
                 stride_row="i64", stride_cs="i64"),
            {"H": heads, "HKV": kv_heads, "D": head_dim})
    compile_for_hopper(fl._silu_mul_kernel,
                       dict(gu_ptr=ptr, out_ptr=ptr, stride_row="i64", n="i32"),
                       {"BLOCK": fl.SILU_BLOCK})


@pytest.mark.skipif(not HAVE_BACKEND, reason="this Triton has no NVIDIA backend")
def test_the_check_can_fail():
    """A kernel the compiler rejects (here: a block that is not a power of two) is
    refused on this machine, not first on a GPU."""
    from triton.compiler.errors import CompilationError

    from libs.kernels import fused_layer as fl

    with pytest.raises(CompilationError, match="power of 2"):
        compile_for_hopper(fl._silu_mul_kernel,
                           dict(gu_ptr="*bf16", out_ptr="*bf16", stride_row="i64", n="i32"),
                           {"BLOCK": 1000})  # tl.arange needs a power of two
