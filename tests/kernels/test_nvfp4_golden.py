"""Byte identity with ModelOpt in CI, without installing it: our quantize and dequantize
against ModelOpt's own outputs, recorded as sha256 digests by
`python -m bench.nvfp4_crosscheck --write-golden` in a venv that has nvidia-modelopt.

Runs on the CPU (the torch reference) and, where a GPU exists, on CUDA (the Triton kernels).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from bench.nvfp4_crosscheck import digest, digest_values, runs
from libs.kernels import dequantize_nvfp4, quantize_nvfp4

GOLDEN = json.loads((Path(__file__).parent / "data" / "modelopt_nvfp4_golden.json").read_text())

CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
])


def test_golden_file_covers_every_case():
    assert GOLDEN["modelopt"] == "0.47.0"
    assert len(GOLDEN["entries"]) == len(list(runs())) == 42


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_identical_to_modelopt_digests(device):
    mismatches = []
    # runs() is the order write_golden recorded them in
    for entry, (name, x, given) in zip(GOLDEN["entries"], runs(), strict=True):
        assert (entry["case"], entry["dtype"]) == (name, str(x.dtype).removeprefix("torch."))
        # The inputs come from a seeded CPU generator: if they moved, say so, not "differs".
        assert digest(x) == entry["input"], f"{name}: the seeded input changed; re-record"
        packed, scales, s2 = quantize_nvfp4(x.to(device), given)
        ours = {"packed": digest(packed), "scales": digest(scales.view(torch.uint8)),
                "s2": digest(s2.reshape(())),
                "dequantized": digest_values(dequantize_nvfp4(packed, scales, s2, x.dtype))}
        wrong = [k for k, v in ours.items() if v != entry[k]]
        if wrong:
            mismatches.append(f"{name} {x.dtype} s2={entry['given_s2']}: {wrong}")
    assert not mismatches, mismatches
