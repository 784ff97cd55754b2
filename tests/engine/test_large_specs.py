"""The billion-parameter random specs (random:llama3-1b, random:llama3-8b) and the loads
refused before any weight exists: a model too large for the device, NVFP4 on a shape the
format cannot block."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from libs.engine.config import ModelConfig
from libs.engine.engine import DecodeSeq, Engine
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from libs.engine.model import random_weights_on_device
from libs.engine.nvfp4 import Nvfp4Weight, UnsupportedNvfp4Shape, check_nvfp4_shapes
from libs.engine.specs import load_tokenizer, random_config
from libs.engine.weight_budget import ModelTooLarge, available_bytes, check_fits, weight_bytes


def n_params(c: ModelConfig) -> int:
    return weight_bytes(c, torch.int8, "native", "cuda")  # one byte a weight


def test_the_llama3_shapes_have_their_published_parameter_counts():
    small, large = random_config("random:llama3-1b"), random_config("random:llama3-8b")
    assert (small.n_layers, small.dim, small.ffn_dim, small.kv_dim) == (16, 2048, 8192, 512)
    assert small.tie_embeddings and not large.tie_embeddings
    assert (large.n_layers, large.dim, large.ffn_dim, large.kv_dim) == (32, 4096, 14336, 1024)
    assert small.vocab_size == large.vocab_size == 128256
    assert abs(n_params(small) / 1e9 - 1.236) < 0.01  # Llama-3.2-1B: 1.24B
    assert abs(n_params(large) / 1e9 - 8.030) < 0.01  # Llama-3-8B: 8.03B
    # the bytes a decode step reads: bf16 16 GB; NVFP4 layers, lm_head in bf16 about 5 GB
    assert 15.9e9 < weight_bytes(large, torch.bfloat16, "native", "cuda") < 16.1e9
    assert 5.0e9 < weight_bytes(large, torch.bfloat16, "nvfp4", "cuda") < 6.2e9


def test_device_weights_are_seeded_and_nvfp4_quantizes_the_same_draw():
    c = ModelConfig.tiny()
    a = random_weights_on_device(c, 7, "cpu", torch.bfloat16)
    b = random_weights_on_device(c, 7, "cpu", torch.bfloat16)
    other = random_weights_on_device(c, 8, "cpu", torch.bfloat16)
    assert a.embed.dtype == torch.bfloat16 and a.lm_head is a.embed
    assert torch.equal(a.layers[1].w_down, b.layers[1].w_down)
    assert not torch.equal(a.layers[1].w_down, other.layers[1].w_down)
    q = random_weights_on_device(c, 7, "cpu", torch.bfloat16, nvfp4=True)
    assert isinstance(q.layers[1].w_down, Nvfp4Weight)
    expected = Nvfp4Weight.quantize(a.layers[1].w_down)
    assert torch.equal(q.layers[1].w_down.packed, expected.packed)
    assert torch.equal(q.embed, a.embed)


def test_llama3_1b_serves_a_tiny_prompt_on_the_cpu():
    m = load_model("random:llama3-1b", "cpu", torch.bfloat16)
    assert m.weights.embed.dtype == torch.bfloat16 and m.weights.embed.shape == (128256, 2048)
    pool = KvPool(m.config, 4, 16, device="cpu", dtype=torch.bfloat16)
    engine = Engine(m.config, m.weights, pool)
    pages = pool.alloc(1)
    first = int(engine.prefill([1, 2, 3, 4], pages).argmax())
    logits = engine.decode_step([DecodeSeq(pages, 4, first)])
    assert logits.shape == (1, 128256) and torch.isfinite(logits.float()).all()


def test_ids_past_the_tokenizer_decode_to_no_text():
    """The Llama shapes' vocabulary outgrows SmolLM2's tokenizer (specs.random_config)."""
    config, tok = load_tokenizer("random:llama3-8b")
    assert tok.vocab_size < config.vocab_size
    hello = tok.encode("hello")
    assert tok.decode([*hello, config.vocab_size - 1, *hello]) == "hellohello"


def test_a_model_too_large_is_refused_with_the_bytes_needed_and_available():
    c = random_config("random:llama3-8b")
    need = weight_bytes(c, torch.bfloat16, "native", "cuda")
    with pytest.raises(ModelTooLarge) as info:
        check_fits("random:llama3-8b", c, torch.device("cuda"), torch.bfloat16, "native",
                   available=need - 1)
    assert f"need {need:,} bytes" in str(info.value)
    assert f"{need - 1:,} bytes" in str(info.value) and "--weights nvfp4" in str(info.value)
    assert check_fits("random:llama3-8b", c, torch.device("cuda"), torch.bfloat16, "native",
                      available=need) == need


@pytest.mark.skipif(available_bytes(torch.device("cpu")) > 32e9, reason="32 GB of RAM free")
def test_llama3_8b_in_fp32_is_refused_on_this_cpu_before_allocating():
    with pytest.raises(ModelTooLarge, match=r"need 32,121,044,992 bytes .* available"):
        load_model("random:llama3-8b", "cpu")


@pytest.mark.skipif(available_bytes(torch.device("cpu")) > 32e9, reason="32 GB of RAM free")
def test_a_member_refuses_a_model_too_large_in_one_line_and_does_not_restart():
    out = subprocess.run(
        [sys.executable, "-m", "pdmesh.cli", "prefill", "--model", "random:llama3-8b",
         "--bootstrap", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.splitlines()[-1]
    assert last.startswith("pdmesh prefill: --model random:llama3-8b: random:llama3-8b does "
                           "not fit cpu: its native float32 weights need 32,121,044,992 bytes")


def test_nvfp4_on_a_shape_it_cannot_block_is_refused_naming_the_layer(tmp_path):
    odd = replace(ModelConfig.tiny(), ffn_dim=100)
    with pytest.raises(UnsupportedNvfp4Shape, match=r"layers\.0\.mlp\.down_proj .*\[64, 100\]"):
        check_nvfp4_shapes(odd)
    check_nvfp4_shapes(random_config("random:llama3-8b"))  # every Llama-3 linear blocks
    # through the loader, from config.json alone: no weight file is needed to refuse
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "intermediate_size": 100, "num_hidden_layers": 2, "vocab_size": 49152,
    }))
    with pytest.raises(UnsupportedNvfp4Shape, match="mlp.down_proj"):
        load_model(str(tmp_path), "cpu", weights_format="nvfp4")
