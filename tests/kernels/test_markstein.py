"""The CUDA quantize kernel's division-free quotient equals IEEE division.

The kernel (quantize_kernel._codes_fast) replaces x / d by a reciprocal and Markstein
correction steps: one for bf16 and fp16 inputs, two for fp32. markstein_check.c proves the
one-step claim exhaustively over every bf16 and fp16 significand against every fp32 d on
this machine's FMA (same IEEE single-precision operations as the GPU's FFMA), and
spot-checks the two-step fp32 case, which is Markstein's theorem. The same check with no
correction step must fail, so the harness can tell a wrong method from a right one.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("markstein_check.c")
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("markstein") / "markstein_check"
    # -ffp-contract=off: only the fmaf calls may fuse, as in the kernel.
    flags = ["-O2", "-ffp-contract=off", "-march=native"]
    subprocess.run([CC, *flags, str(SOURCE), "-o", str(exe), "-lm"], check=True)
    return exe


def run(exe: Path, *args: int) -> tuple[int, str]:
    done = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout


@pytest.mark.parametrize(("xbits", "cases"), [(7, 1 << 30), (10, 1 << 33)], ids=["bf16", "fp16"])
def test_one_step_is_exact_for_16_bit_inputs(checker, xbits, cases):
    rc, out = run(checker, xbits, 1)
    assert f"cases={cases} mismatches=0" in out, out
    assert rc == 0


def test_two_steps_exact_on_random_fp32(checker):
    rc, out = run(checker, 23, 2, 50_000_000)
    assert "mismatches=0" in out and rc == 0, out


def test_the_check_can_fail(checker):
    # The bare product x * fl(1/d) is often one ulp off: the harness must see that.
    rc, out = run(checker, 7, 0)
    assert "mismatches=0" not in out and rc == 1, out
