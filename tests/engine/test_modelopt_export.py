"""Real ModelOpt exports load, and hold exactly the bytes our own quantizer makes.

The fixtures in tests/engine/data were written by nvidia-modelopt 0.47.0 itself
(`data/make_modelopt_checkpoints.py`, run where ModelOpt is installed): a small random bf16
Llama, and ModelOpt's NVFP4 export of it twice, weight-only (quant_algo `W4A16_NVFP4`) and
with input quantizers (quant_algo `NVFP4`, an `input_scale` per linear). The checkpoint
loader was written from ModelOpt's source; these check it against ModelOpt's own output.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from libs.engine.loader import load_model
from libs.engine.modelopt import FUSED
from libs.engine.nvfp4 import LINEARS, Nvfp4Weight

from .helpers import engine_for, greedy_logits

DATA = Path(__file__).parent / "data"
EXPORTS = {"W4A16_NVFP4": DATA / "modelopt_tiny_w4a16", "NVFP4": DATA / "modelopt_tiny_w4a4"}


def _logits(loaded, prompt: list[int]) -> torch.Tensor:
    return greedy_logits(engine_for(loaded), prompt, steps=3)


def test_fixtures_are_what_modelopt_wrote():
    for algo, path in EXPORTS.items():
        text = (path / "hf_quant_config.json").read_text()
        assert f'"quant_algo": "{algo}"' in text and '"name": "modelopt"' in text
    with safe_open(EXPORTS["NVFP4"] / "model.safetensors", "pt") as f:
        scales = [k for k in f.keys() if k.endswith("input_scale")]
    assert len(scales) == 14  # 7 linears x 2 layers: the W4A4 export really has them


@pytest.mark.parametrize("algo", list(EXPORTS))
def test_modelopt_export_loads_with_our_quantizers_bytes(algo):
    exported = load_model(str(EXPORTS[algo]))
    ours = load_model(str(DATA / "modelopt_tiny_bf16"), weights_format="nvfp4")
    assert exported.config == replace(ours.config, name=exported.config.name)
    for i, (theirs, mine) in enumerate(zip(exported.weights.layers, ours.weights.layers,
                                           strict=True)):
        for field in LINEARS:
            a, b = getattr(theirs, field), getattr(mine, field)
            assert isinstance(a, Nvfp4Weight) and isinstance(b, Nvfp4Weight)
            where = f"layer {i} {field} ({', '.join(FUSED[field][1])})"
            assert torch.equal(a.packed, b.packed), where
            assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)), where
            assert torch.equal(a.s2, b.s2), where
    prompt = list(range(3, 40))
    assert torch.equal(_logits(exported, prompt), _logits(ours, prompt))


def test_modelopt_export_stays_close_to_the_bf16_model():
    quantized = _logits(load_model(str(EXPORTS["NVFP4"])), list(range(3, 40)))
    dense = _logits(load_model(str(DATA / "modelopt_tiny_bf16")), list(range(3, 40)))
    rel = ((quantized - dense).norm() / dense.norm()).item()
    assert 0 < rel < 0.05, rel  # 4-bit weights move the logits (0.0057 here), no more
