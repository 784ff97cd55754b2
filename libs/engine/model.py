"""Llama weights as plain tensors plus the per-layer math (RMSNorm, RoPE, SwiGLU).

q/k/v are fused into one ``wqkv`` matrix and gate/up into ``w_gate_up`` so that a layer does
three big matmuls instead of six small ones; on CPU that is most of decode's time. On CUDA
the elementwise math between them runs as one Triton kernel per piece (residual add with
RMSNorm, RoPE on q and k, SiLU * up: libs/kernels/fused_layer.py; a decode step's RoPE
and KV write are one kernel, libs/kernels/paged_attention.py), since there a decode
step's cost is mostly its number of kernels; the torch ops here are the CPU path and the
reference those kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import DecodeAttention
from .config import ModelConfig
from .nvfp4 import Linear, Nvfp4Weight, linear


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wqkv: Linear  # [q_dim + 2 * kv_dim, dim]
    wo: Linear  # [dim, q_dim]
    ffn_norm: torch.Tensor  # [dim]
    w_gate_up: Linear  # [2 * ffn_dim, dim]
    w_down: Linear  # [dim, ffn_dim]


@dataclass
class Weights:
    embed: torch.Tensor  # [vocab, dim]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [dim]
    lm_head: torch.Tensor  # [vocab, dim]; the same tensor as embed when tied

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Weights:
        """Dense tensors move and cast; NVFP4 linears keep their bits (see nvfp4.py)."""
        dtype = dtype or self.dtype

        def mv(t: Linear) -> Linear:
            if isinstance(t, Nvfp4Weight):
                return t.to(device, dtype)
            return t.to(device=device, dtype=dtype).contiguous()

        embed = mv(self.embed)
        lm_head = embed if self.lm_head is self.embed else mv(self.lm_head)
        layers = [LayerWeights(*(mv(t) for t in vars(lw).values())) for lw in self.layers]
        return Weights(embed=embed, layers=layers, norm=mv(self.norm), lm_head=lm_head)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def from_separate(
    config: ModelConfig,
    embed: torch.Tensor,
    norm: torch.Tensor,
    lm_head: torch.Tensor | None,
    layers: list[dict[str, torch.Tensor]],
) -> Weights:
    """Build Weights from HF-named per-layer projections (q, k, v, o, gate, up, down, norms)."""
    fused = [
        LayerWeights(
            attn_norm=lw["input_layernorm"],
            wqkv=torch.cat([lw["q_proj"], lw["k_proj"], lw["v_proj"]], 0),
            wo=lw["o_proj"],
            ffn_norm=lw["post_attention_layernorm"],
            w_gate_up=torch.cat([lw["gate_proj"], lw["up_proj"]], 0),
            w_down=lw["down_proj"],
        )
        for lw in layers
    ]
    head = embed if (lm_head is None or config.tie_embeddings) else lm_head
    return Weights(embed=embed, layers=fused, norm=norm, lm_head=head)


def random_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """Seeded weights drawn on CPU, so the same seed gives the same bits on any machine.

    The embedding has unit scale so that (tied) logits are peaked: greedy decoding of a random
    model then has few near-ties, which keeps cross-device comparisons meaningful.
    """
    g = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    c = config
    layers = [
        LayerWeights(
            attn_norm=torch.ones(c.dim),
            wqkv=lin(c.q_dim + 2 * c.kv_dim, c.dim),
            wo=lin(c.dim, c.q_dim),
            ffn_norm=torch.ones(c.dim),
            w_gate_up=lin(2 * c.ffn_dim, c.dim),
            w_down=lin(c.dim, c.ffn_dim),
        )
        for _ in range(c.n_layers)
    ]
    embed = torch.randn(c.vocab_size, c.dim, generator=g)
    lm_head = embed if c.tie_embeddings else lin(c.vocab_size, c.dim)
    return Weights(embed=embed, layers=layers, norm=torch.ones(c.dim), lm_head=lm_head)


def random_weights_on_device(
    config: ModelConfig, seed: int, device: torch.device | str, dtype: torch.dtype,
    nvfp4: bool = False,
) -> Weights:
    """Seeded weights drawn on `device` in `dtype` directly, for the billion-parameter
    shapes: Llama-3-8B in fp32 on the CPU would be 32 GB and minutes of drawing before
    the copy to the GPU; drawn there in bf16 it is 16 GB and well under a second.

    The bits depend on the device and dtype (each device's generator draws its own
    numbers); a prefill and a decode on the same device and dtype draw the same weights.
    With `nvfp4` each layer linear is quantized as soon as it is drawn, so the dense
    copy of only one matrix is alive at a time (NVFP4 Llama-3-8B: ~6 GB, never 16).
    Scales as random_weights: unit embedding, linears 1/sqrt(fan-in)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def lin(out_f: int, in_f: int) -> Linear:
        w = draw(out_f, in_f).mul_(in_f**-0.5)
        return Nvfp4Weight.quantize(w) if nvfp4 else w

    c = config
    layers = [
        LayerWeights(
            attn_norm=torch.ones(c.dim, device=device, dtype=dtype),
            wqkv=lin(c.q_dim + 2 * c.kv_dim, c.dim),
            wo=lin(c.dim, c.q_dim),
            ffn_norm=torch.ones(c.dim, device=device, dtype=dtype),
            w_gate_up=lin(2 * c.ffn_dim, c.dim),
            w_down=lin(c.dim, c.ffn_dim),
        )
        for _ in range(c.n_layers)
    ]
    embed = draw(c.vocab_size, c.dim)
    lm_head = embed if c.tie_embeddings else draw(c.vocab_size, c.dim).mul_(c.dim**-0.5)
    norm = torch.ones(c.dim, device=device, dtype=dtype)
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


# Where the fused Triton kernels (libs/kernels/fused_layer.py) replace the torch ops below:
# None (the default) on CUDA tensors only; on CPU the torch ops are the fast path and the
# reference. True: everywhere, which on CPU needs Triton's interpreter (TRITON_INTERPRET=1),
# for tests and bench/layer_ops.py. False: nowhere, for GPU tests against the torch ops.
FUSED_KERNELS: bool | None = None


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda if FUSED_KERNELS is None else FUSED_KERNELS


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in torch ops: the CPU path, and the reference of the fused kernel."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in fp32, scale in the model dtype."""
    if _fused(x):
        from libs.kernels import fused_layer

        return fused_layer.rms_norm(x, weight, eps)
    return _torch_rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """The residual add, in place (``x += delta``), then RMSNorm of the sum: the pair every
    block boundary of a layer has, one kernel where the fused kernels run."""
    if _fused(x):
        from libs.kernels import fused_layer

        return fused_layer.add_rms_norm(x, delta, weight, eps)
    return _torch_rms_norm(x.add_(delta), weight, eps)


def rope_tables(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, [max_position, head_dim], HF's rotate_half layout."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    t = torch.arange(config.max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def attention_block(h: torch.Tensor, lw: LayerWeights, c: ModelConfig, cos: torch.Tensor,
                    sin: torch.Tensor, attend: Callable[..., torch.Tensor],
                    layer: int) -> torch.Tensor:
    """A layer's attention on its normed input h [..., dim] (decode [B, dim], prefill
    [1, T, dim]): qkv, RoPE, ``attend(q, k, v, layer)`` over the KV pool, wo. cos/sin
    hold each row's position, broadcasting over heads ([B, 1, D] or [1, T, 1, D])."""
    qkv = linear(h, lw.wqkv)
    lead, d = qkv.shape[:-1], c.head_dim
    if _fused(qkv) and isinstance(attend, DecodeAttention) and attend.fuses_rope:
        # a decode step on the GPU: RoPE and the KV write in one kernel
        return linear(attend.rope_and_attend(qkv, cos, sin, layer, c.n_heads), lw.wo)
    if _fused(qkv) and d & (d - 1) == 0:  # the kernel's halves are power-of-two blocks
        from libs.kernels import fused_layer

        q, k = fused_layer.rope_qk(qkv, cos, sin, c.n_heads, c.n_kv_heads, d)
    else:
        q = apply_rope(qkv[..., : c.q_dim].view(*lead, c.n_heads, d), cos, sin)
        k = apply_rope(qkv[..., c.q_dim : c.q_dim + c.kv_dim].view(*lead, c.n_kv_heads, d),
                       cos, sin)
    v = qkv[..., c.q_dim + c.kv_dim :].view(*lead, c.n_kv_heads, d)
    return linear(attend(q, k, v, layer), lw.wo)


def swiglu_mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    gate_up = linear(x, lw.w_gate_up)
    if _fused(gate_up):
        from libs.kernels import fused_layer

        return linear(fused_layer.silu_mul(gate_up), lw.w_down)
    gate, up = gate_up.chunk(2, -1)
    return linear(F.silu(gate) * up, lw.w_down)
