"""The Triton kernels of every decode step, the fused layer kernels
(libs/kernels/fused_layer.py), paged attention (libs/kernels/paged_attention.py) and the
greedy argmax (libs/kernels/argmax.py),
compile for Hopper (sm_90) here, with no GPU: Triton's own compiler, down to a cubin
through the ptxas its wheel carries.

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

try:
    from triton.backends import backends as TRITON_BACKENDS
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    HOPPER = GPUTarget("cuda", 90, 32)
    HAVE_BACKEND = "nvidia" in TRITON_BACKENDS
except ImportError:  # a Triton without the NVIDIA backend
    HAVE_BACKEND = False

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="under the interpreter @triton.jit is not compiled"),
    pytest.mark.skipif(not HAVE_BACKEND, reason="this Triton has no NVIDIA backend"),
]

DTYPES = ["bf16", "fp16", "fp32"]
# (dim, heads, kv heads, head_dim): SmolLM2-135M, Llama-3.2-1B, Llama-3-8B, the tiny spec
SHAPES = [(576, 9, 3, 64), (2048, 32, 8, 64), (4096, 32, 8, 128), (64, 4, 2, 16)]
PAGE = 16  # tokens a KV page


def compile_for_hopper(kernel, types: dict[str, str], constexprs: dict[str, object],
                       num_warps: int = 4):
    """Compile `kernel` with these argument types and constexpr values for sm_90."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps})
    assert compiled.asm["cubin"], "no cubin"
    return compiled


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_paged_attention_kernels_compile_for_hopper(dtype):
    """store_kv, rope_store_kv and the decode attention (one range of keys, or split with
    its partials combined by the last split), with the constexprs their wrappers give."""
    from libs.kernels import paged_attention as pa

    ptr, i32, i64 = f"*{dtype}", "i32", "i64"
    for _, heads, kv_heads, head_dim in SHAPES:
        compile_for_hopper(
            pa._store_kv_kernel,
            dict(k_ptr=ptr, v_ptr=ptr, cache_ptr=ptr, table_ptr="*i32", lengths_ptr="*i32",
                 layer_offset=i64, stride_kb=i64, stride_kh=i64, stride_vb=i64,
                 stride_vh=i64, stride_tb=i64, stride_lb=i64, page_stride=i64,
                 kv_stride=i64, head_stride=i64),
            {"HKV": kv_heads, "HKV_PAD": pa._pow2(kv_heads), "D": head_dim,
             "D_PAD": pa._pow2(head_dim), "PAGE": PAGE}, num_warps=1)
        group, d_pad = heads // kv_heads, pa._pow2(head_dim, 16)
        for split in (False, True):
            part = "*fp32" if split else ptr
            compile_for_hopper(
                pa._decode_kernel,
                dict(q_ptr=ptr, cache_ptr=ptr, table_ptr="*i32", lengths_ptr="*i32",
                     out_ptr=ptr, part_m_ptr=part, part_l_ptr=part, part_acc_ptr=part,
                     cnt_ptr="*i32" if split else ptr,
                     layer_offset=i64, stride_qb=i64, stride_qh=i64, stride_tb=i64,
                     stride_lb=i64, stride_ob=i64, stride_oh=i64, page_stride=i64,
                     kv_stride=i64, head_stride=i64, num_splits=i32, qk_scale="fp32"),
                {"G": group, "G_PAD": pa._pow2(group, 16), "D": head_dim, "D_PAD": d_pad,
                 "PAGE": PAGE, "BLOCK": pa.BLOCK_N, "SPLIT": split,
                 "S_PAD": pa._pow2(pa.MAX_SPLITS) if split else 1,
                 "DOT_F32": dtype == "fp32", "INTERPRETED": False})
        compile_for_hopper(
            pa._rope_store_kernel,
            dict(qkv_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr, q_ptr=ptr, cache_ptr=ptr,
                 table_ptr="*i32", lengths_ptr="*i32", layer_offset=i64, stride_row=i64,
                 stride_cs=i64, stride_tb=i64, stride_lb=i64, page_stride=i64,
                 kv_stride=i64, head_stride=i64),
            {"H": heads, "HKV": kv_heads, "D": head_dim, "PAGE": PAGE}, num_warps=1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_greedy_argmax_kernels_compile_for_hopper(dtype):
    from libs.kernels import argmax as am

    compile_for_hopper(
        am._chunk_kernel,
        dict(x_ptr=f"*{dtype}", best_ptr="*fp32", index_ptr="*i32", nan_ptr="*i32",
             stride_row="i64", n="i32", chunk="i32", n_chunks="i32"),
        {"BLOCK": am.BLOCK, "INTERPRETED": False})
    compile_for_hopper(
        am._pick_kernel,
        dict(best_ptr="*fp32", index_ptr="*i32", nan_ptr="*i32", out_ptr="*i64",
             n_chunks="i32"),
        {"C_PAD": 1024}, num_warps=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_nvfp4_kv_page_kernels_compile_for_hopper(dtype):
    """The wire format's encode (pool pages into slots) and decode, for each served
    model's KV page, with the constexprs encode_pages and decode_pages give them."""
    import torch

    from libs.kernels.nvfp4 import kv_pages
    from libs.transfer.kvwire import Nvfp4PageFormat

    ptr = f"*{dtype}"
    for layers, _, kv_heads, head_dim in [(30, 9, 3, 64), (16, 32, 8, 64), (32, 32, 8, 128)]:
        fmt = Nvfp4PageFormat(layers, kv_heads, PAGE, head_dim)
        pool = torch.empty((1, *fmt.page_shape), device="meta")
        shape = kv_pages._shape(pool, torch.empty((1, fmt.slot_bytes), device="meta"))
        compile_for_hopper(
            kv_pages.encode_pages_kernel,
            dict(pool_ptr=ptr, index_ptr="*i64", slots_ptr="*u8", slots_f32_ptr="*fp32",
                 bad_ptr="*i32", n_pages="i32", last_tokens="i32"),
            {"ROW_BLOCKS": head_dim // 16, "PAGE": PAGE, **shape})
        compile_for_hopper(
            kv_pages.decode_pages_kernel,
            dict(slots_ptr="*u8", slots_f32_ptr="*fp32", index_ptr="*i64", pool_ptr=ptr),
            shape)


def test_the_check_can_fail():
    """A kernel the compiler rejects (here: a block that is not a power of two) is
    refused on this machine, not first on a GPU."""
    from triton.compiler.errors import CompilationError

    from libs.kernels import fused_layer as fl

    with pytest.raises(CompilationError, match="power of 2"):
        compile_for_hopper(fl._silu_mul_kernel,
                           dict(gu_ptr="*bf16", out_ptr="*bf16", stride_row="i64", n="i32"),
                           {"BLOCK": 1000})  # tl.arange needs a power of two
