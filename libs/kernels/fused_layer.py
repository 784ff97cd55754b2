"""The elementwise parts of a Llama layer as one Triton kernel each.

Why: in a CUDA-graph decode step every small kernel costs ~2 us whatever its size, and a
layer written in torch ops launches ~8 for an RMSNorm (dtype round trips, pow, mean, add,
rsqrt, two muls), ~10 for RoPE on q and k (neg, cat, mul, add on each) and 2 for SiLU * up.
Here each is one launch:

- `add_rms_norm`: the residual add and the RMSNorm that follows it (``x + delta`` is
  written back, and its norm returned); `rms_norm` without the add.
- `rope_qk`: RoPE on the q and k heads of a fused qkv row, into new contiguous q and k
  (prefill's; a decode step's RoPE is fused with its KV write, paged_attention.py, through
  the same `rope_head`).
- `silu_mul`: ``silu(gate) * up`` of a fused gate/up row.

Each rounds where the torch reference (libs/engine/model.py) rounds, so that the results
equal it up to the order of a sum: the norm's statistics in fp32 and the normalised row
cast to the model's dtype before the weight scales it; RoPE's two products each rounded to
the dtype before their sum; SiLU rounded before the product. Rows are the leading
dimensions flattened; the last dimension must be contiguous. Tested against the torch
reference under Triton's interpreter on CPU tensors (tests/kernels/test_fused_layer.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:  # the residual add, rounded to the dtype as torch's add is, and written back
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(x.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, dim] without a copy (the last dimension must be contiguous)."""
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    return x.view(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm of x [..., dim] in one kernel."""
    xr = _rows(x)
    out = torch.empty_like(xr)
    _launch_norm(xr, xr, weight, out, eps, add=False)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``x += delta`` in place, and returns rms_norm(x), in one kernel (x [..., dim]
    contiguous: it is the residual stream the caller keeps)."""
    if not x.is_contiguous():
        raise ValueError("the residual x must be contiguous")
    xr, dr = _rows(x), _rows(delta)
    out = torch.empty_like(xr)
    _launch_norm(xr, dr, weight, out, eps, add=True)
    return out.view(x.shape)


def _launch_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 out: torch.Tensor, eps: float, add: bool) -> None:
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, delta, weight, out, x.stride(0), delta.stride(0), out.stride(0), n, eps,
        ADD=add, BLOCK=triton.next_power_of_2(n),
    )


@triton.jit
def rope_head(src, cs_offset, cos_ptr, sin_ptr, D: tl.constexpr):
    """One head of D values at `src` under RoPE (HF rotate_half layout) with the cos/sin
    row at `cs_offset`: its two halves, in the head's dtype. Each product is rounded to
    the dtype before the sum, as torch rounds x * cos + rotate_half(x) * sin. Shared with
    the decode step's rope-and-store kernel (paged_attention.rope_store_kv)."""
    half = tl.arange(0, D // 2)
    x1 = tl.load(src + half)
    x2 = tl.load(src + D // 2 + half)
    c1 = tl.load(cos_ptr + cs_offset + half).to(tl.float32)
    c2 = tl.load(cos_ptr + cs_offset + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + cs_offset + half).to(tl.float32)
    s2 = tl.load(sin_ptr + cs_offset + D // 2 + half).to(tl.float32)
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_row, stride_cs,
                 H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then k heads, as in the fused qkv row
    half = tl.arange(0, D // 2)
    o1, o2 = rope_head(qkv_ptr + row * stride_row + head * D, row * stride_cs, cos_ptr,
                       sin_ptr, D)
    if head < H:
        dst = q_ptr + (row * H + head) * D
    else:
        dst = k_ptr + (row * HKV + head - H) * D
    tl.store(dst + half, o1)
    tl.store(dst + D // 2 + half, o2)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
            n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (HF rotate_half layout) on the q and k heads of qkv [..., (H + 2 Hkv) * D],
    with cos/sin [rows, D] of each row's position: q [..., H, D] and k [..., Hkv, D],
    new contiguous tensors, in one kernel. head_dim must be a power of two."""
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_qk needs a power-of-two head_dim, got {head_dim}")
    rows = _rows(qkv)
    n = rows.shape[0]
    cos, sin = cos.reshape(n, head_dim), sin.reshape(n, head_dim)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same contiguous rows")
    lead = qkv.shape[:-1]
    q = torch.empty((*lead, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((*lead, n_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_kernel[(n, n_heads + n_kv_heads)](
        rows, cos, sin, q, k, rows.stride(0), cos.stride(0),
        H=n_heads, HKV=n_kv_heads, D=head_dim,
    )
    return q, k


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_row, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gu_ptr + row * stride_row + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_row + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (silu * u.to(tl.float32)).to(g.dtype), mask=mask)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up [..., 2 * F] (gate first), [..., F], in one kernel."""
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, SILU_BLOCK))](
        rows, out, rows.stride(0), n, BLOCK=SILU_BLOCK,
    )
    return out.view(*gate_up.shape[:-1], n)
