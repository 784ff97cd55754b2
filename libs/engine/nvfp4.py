"""NVFP4 linear weights for the engine (`--weights nvfp4`): weight-only, W4A16.

Each layer's four fused linears (wqkv, wo, w_gate_up, w_down) become an `Nvfp4Weight`;
embeddings, norms and lm_head stay dense, as in ModelOpt's recipe (it excludes lm_head).
Activations are never quantized: the matmul runs in the engine's dtype, which is how Hopper
serves NVFP4 checkpoints (docs/nvfp4.md).

Fusion and the global scale. ModelOpt's export gives the shards it fuses (q/k/v, gate/up)
one shared weight_scale_2, the max of their amaxes (`preprocess_linear_fusion`). Block scales
are per row (16 consecutive inputs of one output row), so quantizing the fused matrix once,
whose amax is exactly that max, gives bit for bit the concatenation of the shards quantized
with the shared s2. The engine therefore quantizes ``wqkv`` and ``w_gate_up`` as they are;
tests check the equivalence shard by shard.

Where the matmul runs. On GPU the packed weight is all that is kept and every linear calls
`nvfp4_linear` (the Triton kernel when it exists, else the torch reference), bound to
the weight by `prepare_nvfp4_linear` so that a decode step pays its host work once.
On CPU there is no FP4 arithmetic at all: the reference dequantizes the whole weight on
every call, which would make a decode step several times slower than the dense engine. So on CPU the
dequantized weight is computed once at load with `dequantize_nvfp4` and kept next to the
packed one; `F.linear(x, dense)` is then exactly what the reference `nvfp4_linear` computes
(it is dequantize-then-F.linear), and tests check that equality bit for bit. The packed form
stays for export, fingerprints and moving to another device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from libs.kernels import PreparedLinear, dequantize_nvfp4, prepare_nvfp4_linear, quantize_nvfp4

if TYPE_CHECKING:  # model.py imports this module
    from .config import ModelConfig
    from .model import Weights

WEIGHT_FORMATS = ("native", "nvfp4")
BLOCK_ELEMENTS = 16  # NVFP4 block: inputs sharing one e4m3 scale
LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")  # LayerWeights fields that NVFP4 replaces


@dataclass
class Nvfp4Weight:
    """A linear weight W [N, K] in NVFP4: W ~ e2m1(packed) * fp32(scales) * s2."""

    packed: torch.Tensor  # uint8 [N, K/2], element 0 in the low nibble
    scales: torch.Tensor  # float8_e4m3fn [N, K/16], linear (checkpoint) layout
    s2: torch.Tensor  # fp32 0-d, decode form (amax / 2688)
    dense: torch.Tensor | None = None  # CPU only: dequantize_nvfp4(...) in the compute dtype
    # GPU: nvfp4_linear bound to this weight, made at its first call (see linear)
    prepared: PreparedLinear | None = field(default=None, repr=False, compare=False)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Nvfp4Weight:
        packed, scales, s2 = quantize_nvfp4(w)
        return cls(packed, scales, s2)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def numel(self) -> int:
        return self.packed.numel() * 2

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scales, self.s2, dtype)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Nvfp4Weight:
        """The same bits on `device`; on CPU with the dense copy in `dtype` (see module doc)."""
        out = Nvfp4Weight(*(t.to(device).contiguous() for t in (self.packed, self.scales, self.s2)))
        if out.device.type == "cpu":
            out.dense = out.dequantize(dtype)
        return out

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T: on CPU F.linear on the dense copy; on GPU nvfp4_linear, through a
        PreparedLinear that does its host work once per x shape (an eager decode step is
        host-bound, and on SmolLM2's layers nvfp4_linear's checks and route cost more host
        time than the kernel takes). Same kernels, same bits."""
        if self.dense is not None:
            return F.linear(x, self.dense)
        if self.prepared is None:
            self.prepared = prepare_nvfp4_linear(self.packed, self.scales, self.s2)
        return self.prepared(x)

    def split(self, sizes: list[int]) -> list[Nvfp4Weight]:
        """Row shards (e.g. q/k/v of wqkv), all keeping the shared s2, as ModelOpt stores them."""
        return [
            Nvfp4Weight(p.contiguous(), s.contiguous(), self.s2)
            for p, s in zip(self.packed.split(sizes), self.scales.split(sizes), strict=True)
        ]

    @classmethod
    def cat(cls, shards: list[Nvfp4Weight]) -> Nvfp4Weight:
        """Fuse row shards that share one s2 (the caller checks they do)."""
        return cls(
            torch.cat([s.packed for s in shards]), torch.cat([s.scales for s in shards]),
            shards[0].s2,
        )


Linear = torch.Tensor | Nvfp4Weight


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """x @ w.T for a dense or an NVFP4 weight: the engine's one entry point for its linears."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return w.linear(x)


class UnsupportedNvfp4Shape(ValueError):
    """A layer linear whose input dimension NVFP4 cannot block (not a multiple of 16)."""


# LayerWeights field -> the checkpoint's name of what it fuses (for messages).
HF_NAMES = {"wqkv": "self_attn.q_proj/k_proj/v_proj", "wo": "self_attn.o_proj",
            "w_gate_up": "mlp.gate_proj/up_proj", "w_down": "mlp.down_proj"}


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[N, K] of each layer linear (the same in every layer)."""
    c = config
    return {"wqkv": (c.q_dim + 2 * c.kv_dim, c.dim), "wo": (c.dim, c.q_dim),
            "w_gate_up": (2 * c.ffn_dim, c.dim), "w_down": (c.dim, c.ffn_dim)}


def check_nvfp4_shapes(config: ModelConfig) -> None:
    """Raise UnsupportedNvfp4Shape naming the first layer linear NVFP4 cannot hold: its
    blocks run 16 inputs along K, and the kernels read whole blocks. From the shape alone,
    so the load is refused before any weight is read or drawn."""
    for field_name, (n, k) in linear_shapes(config).items():
        if k % BLOCK_ELEMENTS:
            raise UnsupportedNvfp4Shape(
                f"--weights nvfp4 cannot quantize layers.0.{HF_NAMES[field_name]} (and the "
                f"same linear of every layer): its weight is [{n}, {k}] and NVFP4 needs the "
                f"input dimension ({k}) to be a multiple of {BLOCK_ELEMENTS}; serve this "
                "model with --weights native"
            )


def quantize_layer_linears(weights: Weights) -> Weights:
    """Weights with every layer's linears in NVFP4 (quantized from their current values);
    embed, norms and lm_head are the same tensors. Already-NVFP4 linears are kept as they are.

    Quantize from the highest-precision copy available (the loader passes fp32, before any
    cast to --dtype), so the NVFP4 bits do not depend on the serving dtype.
    """

    def q(w: Linear) -> Linear:
        return w if isinstance(w, Nvfp4Weight) else Nvfp4Weight.quantize(w)

    layers = [replace(lw, **{f: q(getattr(lw, f)) for f in LINEARS}) for lw in weights.layers]
    return replace(weights, layers=layers)


def is_nvfp4(weights: Weights) -> bool:
    """True when any layer linear is NVFP4 (a ModelOpt checkpoint may exclude some)."""
    return any(isinstance(getattr(lw, f), Nvfp4Weight) for lw in weights.layers for f in LINEARS)
