"""Byte-for-byte comparison with ModelOpt and torchao, where they are installed.

They are not pdmesh dependencies, so in the project venv these skip (a skip is not a pass).
bench/nvfp4_crosscheck.py documents how to run them and the result last recorded.
"""

import pytest

from bench import nvfp4_crosscheck


def test_identical_to_modelopt():
    pytest.importorskip("modelopt.torch.quantization.qtensor")
    assert nvfp4_crosscheck.check_modelopt()


def test_torchao_differences_are_only_the_documented_ones():
    pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    assert nvfp4_crosscheck.check_torchao()
