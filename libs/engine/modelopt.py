"""ModelOpt NVFP4 checkpoints (the unified Hugging Face export): read, validate, write.

A directory is one when it has ``hf_quant_config.json`` next to ``config.json``. Per
quantized linear ``<m>`` (docs/nvfp4.md describes the format):

    <m>.weight          uint8          [out, in/2]   two E2M1 codes a byte, low nibble first
    <m>.weight_scale    float8_e4m3fn  [out, in/16]  block scales, linear layout
    <m>.weight_scale_2  float32        scalar        s2 = amax / 2688, shared by fused shards
    <m>.input_scale     float32        scalar        NVFP4 (W4A4) only; ignored

``input_scale`` is ignored because this engine is weight-only (W4A16): activations stay in
--dtype, as Marlin serves NVFP4 on Hopper. KV scales (``k_scale``/``v_scale``) are ignored for
the same reason: the KV cache stays in --dtype. Modules named in ``exclude_modules``
(fnmatch patterns or module prefixes; ModelOpt always lists lm_head) are plain float weights.

Everything the engine cannot serve exactly is refused with a `CheckpointError` naming the
file and tensor: another quant_algo (NVFP4_AWQ's pre_quant_scale, FP8, ...), a group size
other than 16, a missing or mis-typed or mis-shaped tensor, a non-positive s2, NaN block
scales, fused shards (q/k/v, gate/up) that do not share s2 or are only partly excluded.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .model import LayerWeights, Weights
from .nvfp4 import Linear, Nvfp4Weight, quantize_layer_linears

logger = logging.getLogger(__name__)

HF_QUANT_CONFIG = "hf_quant_config.json"
# ModelOpt names the format NVFP4 when activations are quantized too (W4A4: input_scale per
# linear, ignored here) and W4A16_NVFP4 when only weights are; the weights are stored alike.
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")
GROUP_SIZE = 16
PRODUCER = "pdmesh"

# The engine's fused linears and the HF modules they fuse, in row order.
ATTN, MLP = "self_attn", "mlp"
FUSED = {
    "wqkv": (ATTN, ("q_proj", "k_proj", "v_proj")),
    "wo": (ATTN, ("o_proj",)),
    "w_gate_up": (MLP, ("gate_proj", "up_proj")),
    "w_down": (MLP, ("down_proj",)),
}


class CheckpointError(ValueError):
    """A checkpoint this engine cannot load exactly; the message names the file and tensor."""


@dataclass(frozen=True)
class QuantConfig:
    exclude_modules: tuple[str, ...]
    kv_cache_quant_algo: str | None

    def excluded(self, module: str) -> bool:
        """`module` is a full name (``model.layers.0.mlp.up_proj``); patterns may omit
        ``model.`` or name a parent module."""
        names = {module, module.removeprefix("model.")}
        return any(
            fnmatch.fnmatchcase(n, p) or n.startswith(p + ".")
            for p in self.exclude_modules for n in names
        )


def read_quant_config(path: Path) -> QuantConfig | None:
    """The validated hf_quant_config.json of checkpoint dir `path`, None when it has none."""
    file = path / HF_QUANT_CONFIG
    if not file.exists():
        return None
    try:
        q = json.loads(file.read_text())["quantization"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: not a ModelOpt quant config ({e!r})") from None
    if not isinstance(q, dict):
        raise CheckpointError(f"{file}: 'quantization' must be an object")
    if q.get("quant_algo") not in QUANT_ALGOS:
        raise CheckpointError(
            f"{file}: quant_algo {q.get('quant_algo')!r} is not supported "
            f"(only {' or '.join(repr(a) for a in QUANT_ALGOS)})"
        )
    # ModelOpt always writes it; absent, the scale shapes below still enforce 16.
    if q.get("group_size", GROUP_SIZE) != GROUP_SIZE:
        raise CheckpointError(
            f"{file}: group_size {q['group_size']!r} is not supported (NVFP4 uses {GROUP_SIZE})"
        )
    exclude = q.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise CheckpointError(f"{file}: exclude_modules must be a list of strings")
    kv = q.get("kv_cache_quant_algo")
    if kv:
        logger.info("%s: kv_cache_quant_algo %s ignored: the KV cache stays in --dtype", file, kv)
    return QuantConfig(tuple(exclude), kv)


def refuse_unknown_quantization(path: Path, hf: dict, tensors: TensorFiles) -> None:
    """A plain HF dir must hold float weights: anything else would load as garbage."""
    qc = hf.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(
            f"{path / 'config.json'}: quantization_config (quant_method {method!r}) without "
            f"{HF_QUANT_CONFIG}: only ModelOpt NVFP4 checkpoints are supported"
        )
    for name, t in tensors.items():
        if not t.is_floating_point() or t.element_size() == 1:
            raise CheckpointError(
                f"{tensors.file_of(name)}: tensor {name} is {t.dtype}, a quantized weight, "
                f"but {path} has no {HF_QUANT_CONFIG}"
            )


class TensorFiles:
    """Every tensor of a directory's *.safetensors, remembering which file holds which."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        self._tensors: dict[str, torch.Tensor] = {}
        self._file: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    # A fresh (64-byte aligned) copy: safetensors 0.8.0's tensors can start at
                    # any 8-byte offset (40 mod 64 seen), and CPU BLAS sums a one-row product
                    # in another order on a misaligned weight, so the same bits loaded from a
                    # checkpoint and quantized at load gave different logits.
                    self._tensors[name] = st.get_tensor(name).clone()
                    self._file[name] = f

    def items(self):
        return self._tensors.items()

    def _key(self, name: str) -> str | None:
        """The stored key of full HF name `name` (a base-model save lacks ``model.``)."""
        for n in (name, name.removeprefix("model.")):
            if n in self._tensors:
                return n
        return None

    def file_of(self, name: str) -> Path:
        return self._file.get(self._key(name) or name, self.path)

    def has(self, name: str) -> bool:
        return self._key(name) is not None

    def get(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        return self._tensors[key]

    def error(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.file_of(name)}: tensor {name}: {why}")


def _expect(files: TensorFiles, name: str, dtype: torch.dtype, shape: tuple[int, ...]):
    t = files.get(name)
    if t.dtype != dtype:
        raise files.error(name, f"dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != shape:
        raise files.error(name, f"shape {tuple(t.shape)}, expected {list(shape)}")
    return t


def _load_linear(files: TensorFiles, m: str, out_f: int, in_f: int, quantized: bool) -> Linear:
    """One HF linear `m` (full module name) of shape [out_f, in_f]."""
    w = files.get(m + ".weight")
    if not quantized:
        if not w.is_floating_point() or w.element_size() == 1:
            raise files.error(m + ".weight", f"{w.dtype}, but the module is excluded from "
                              "quantization (exclude_modules): expected a float weight")
        if tuple(w.shape) != (out_f, in_f):
            raise files.error(m + ".weight", f"shape {tuple(w.shape)}, expected {[out_f, in_f]}")
        return w.float()
    if w.is_floating_point():
        raise files.error(m + ".weight", f"{w.dtype}, but {HF_QUANT_CONFIG} does not exclude "
                          f"{m}: expected packed NVFP4 (uint8)")
    if in_f % GROUP_SIZE:
        raise files.error(m + ".weight", f"in_features {in_f} is not a multiple of {GROUP_SIZE}")
    for extra in ("pre_quant_scale", "weight_zero_point"):
        if files.has(f"{m}.{extra}"):
            raise files.error(f"{m}.{extra}", "not plain NVFP4 (AWQ/affine): unsupported")
    packed = _expect(files, m + ".weight", torch.uint8, (out_f, in_f // 2))
    scales = _expect(files, m + ".weight_scale", torch.float8_e4m3fn,
                     (out_f, in_f // GROUP_SIZE))
    if torch.isnan(scales.float()).any():
        raise files.error(m + ".weight_scale", "contains NaN")
    s2 = files.get(m + ".weight_scale_2")
    if s2.dtype != torch.float32 or s2.numel() != 1:
        raise files.error(m + ".weight_scale_2",
                          f"{s2.dtype} {list(s2.shape)}, expected a float32 scalar")
    s2 = s2.reshape(())
    if not (torch.isfinite(s2) and s2 > 0):
        raise files.error(m + ".weight_scale_2", f"{s2.item()} is not positive and finite")
    return Nvfp4Weight(packed.contiguous(), scales.contiguous(), s2.clone())


def _fuse(files: TensorFiles, modules: list[str], shards: list[Linear]) -> Linear:
    if len(shards) == 1:
        return shards[0]
    quantized = [isinstance(s, Nvfp4Weight) for s in shards]
    if any(quantized) and not all(quantized):
        raise CheckpointError(f"{files.path}: {', '.join(modules)} are fused by the engine "
                              "but only some are excluded from quantization")
    if not all(quantized):
        return torch.cat(shards)
    if any(not torch.equal(s.s2, shards[0].s2) for s in shards):
        values = ", ".join(f"{s.s2.item():.6g}" for s in shards)
        raise files.error(modules[0] + ".weight_scale_2",
                          f"fused shards {', '.join(modules)} have different weight_scale_2 "
                          f"({values}); ModelOpt gives fused shards one shared scale")
    return Nvfp4Weight.cat(shards)


def load_weights(files: TensorFiles, config: ModelConfig, quant: QuantConfig) -> Weights:
    """The engine's Weights from a validated ModelOpt NVFP4 checkpoint (linears stay NVFP4)."""
    c = config
    shapes = {  # (out, in) of each HF linear
        "q_proj": (c.q_dim, c.dim), "k_proj": (c.kv_dim, c.dim), "v_proj": (c.kv_dim, c.dim),
        "o_proj": (c.dim, c.q_dim), "gate_proj": (c.ffn_dim, c.dim),
        "up_proj": (c.ffn_dim, c.dim), "down_proj": (c.dim, c.ffn_dim),
    }

    def dense(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = files.get(name)
        if not t.is_floating_point() or t.element_size() == 1:
            raise files.error(name, f"{t.dtype}: only layer linears may be quantized")
        if tuple(t.shape) != shape:
            raise files.error(name, f"shape {tuple(t.shape)}, expected {list(shape)}")
        return t.float()

    layers = []
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        fused = {}
        for field, (block, names) in FUSED.items():
            modules = [f"{p}{block}.{n}" for n in names]
            shards = [
                _load_linear(files, m, *shapes[n], quantized=not quant.excluded(m))
                for m, n in zip(modules, names, strict=True)
            ]
            fused[field] = _fuse(files, modules, shards)
        layers.append(LayerWeights(
            attn_norm=dense(p + "input_layernorm.weight", (c.dim,)),
            ffn_norm=dense(p + "post_attention_layernorm.weight", (c.dim,)),
            **fused,
        ))
    embed = dense("model.embed_tokens.weight", (c.vocab_size, c.dim))
    if c.tie_embeddings or not files.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = dense("lm_head.weight", (c.vocab_size, c.dim))
    return Weights(embed=embed, layers=layers, norm=dense("model.norm.weight", (c.dim,)),
                   lm_head=lm_head)


def hf_config(config: ModelConfig) -> dict:
    """config.json for a Llama of this shape, as the loader's _load_hf_dir reads it back."""
    c = config
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": c.name,
        "hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0],
        "hidden_act": "silu",
    }


def export_nvfp4(config: ModelConfig, weights: Weights, out: Path | str) -> Path:
    """Write `weights` as a ModelOpt-layout NVFP4 checkpoint dir (model.safetensors,
    config.json, hf_quant_config.json). Dense layer linears are quantized first, exactly as
    `--weights nvfp4` does at load; NVFP4 ones are written bit for bit, q/k/v and gate/up split
    into their HF modules with the shared s2 repeated. Embeddings, norms and (untied) lm_head
    keep their dtype. No tokenizer is written: the loader falls back to SmolLM2's.

    Pass fp32 weights (what load_model gives before its dtype cast, or its NVFP4 result) to
    get the same bits as `--weights nvfp4`, which quantizes from fp32."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w = quantize_layer_linears(weights if weights.device.type == "cpu" else weights.to("cpu"))
    c = config
    split = {"wqkv": [c.q_dim, c.kv_dim, c.kv_dim], "w_gate_up": [c.ffn_dim, c.ffn_dim]}
    sd: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        sd[name] = t.detach().clone().contiguous()  # clone: safetensors refuses shared storage

    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", lw.attn_norm)
        put(p + "post_attention_layernorm.weight", lw.ffn_norm)
        for field, (block, names) in FUSED.items():
            lin = getattr(lw, field)
            shards = lin.split(split[field]) if field in split else [lin]
            for name, shard in zip(names, shards, strict=True):
                m = f"{p}{block}.{name}"
                if not isinstance(shard, Nvfp4Weight):
                    raise TypeError(f"{m}: expected an NVFP4 weight")
                put(m + ".weight", shard.packed)
                put(m + ".weight_scale", shard.scales)
                put(m + ".weight_scale_2", shard.s2.float().reshape(()))
    put("model.embed_tokens.weight", w.embed)
    put("model.norm.weight", w.norm)
    if w.lm_head is not w.embed:
        put("lm_head.weight", w.lm_head)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(config), indent=2))
    quant = {
        "producer": {"name": PRODUCER},
        "quantization": {
            "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
            "exclude_modules": ["lm_head"],
        },
    }
    (out / HF_QUANT_CONFIG).write_text(json.dumps(quant, indent=2))
    return out


def main() -> None:
    """python -m libs.engine.modelopt --model smollm2 OUT_DIR"""
    from .loader import load_model

    ap = argparse.ArgumentParser(description="Write a model as a ModelOpt NVFP4 checkpoint dir.")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--model", default="smollm2", help="any model spec load_model accepts")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(args.model, weights_format="nvfp4")
    print(export_nvfp4(loaded.config, loaded.weights, args.out))


if __name__ == "__main__":
    main()
