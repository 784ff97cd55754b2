"""The independent reference: transformers' own Llama, loaded by transformers' own GGUF reader.

The engine's tests compare their tokens with this model's (a wrong un-permute or a wrong norm
in the loader or the engine makes them differ), and the benchmarks time it as the baseline.
It lives beside the loader because it reads the same checkpoint the same loader finds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from libs.engine.loader import smollm2_gguf_path


@contextlib.contextmanager
def _one_tensor_name_map():
    """transformers asks gguf for the GGUF-to-HF tensor-name map once per module of the
    model, 397 times for SmolLM2, about 10 s on one core; the map depends only on its
    arguments (architecture, layer count) and is only read, so within the load it is
    built once. The loading itself is untouched."""
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


def load_hf_reference():
    with _one_tensor_name_map():
        return _load_hf_reference()


def _load_hf_reference():
    path = smollm2_gguf_path()
    if importlib.util.find_spec("accelerate") is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        ).eval()
    # from_pretrained(gguf_file=) insists on accelerate; this is the same transformers loader.
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = LlamaForCausalLM(cfg)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    model.tie_weights()
    return model.float().eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens with transformers' KV cache, no stopping."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = model(torch.tensor([[tok]]), cache=res.cache, use_cache=True)
    return out
