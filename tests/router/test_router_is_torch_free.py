"""The router tokenizes and pairs members but never computes: starting it must not import
torch (~2-5 s of CPU per mesh start on a 2-core host, every mesh test pays it)."""

import subprocess
import sys

CHECK = """
import sys
import services.router.main
from libs.engine.specs import load_tokenizer
config, tokenizer = load_tokenizer("tiny")
assert tokenizer.encode("hello world"), "the tokenizer works"
print("torch" in sys.modules)
"""


def test_router_startup_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


CLI = """
import sys
from pdmesh.cli import build_parser
build_parser()
print(sorted(m for m in ("torch", "nixl", "transformers") if m in sys.modules))
"""


def test_the_cli_builds_every_parser_without_torch():
    """`pdmesh bootstrap|router|up` run through this parser: building it must not import
    torch or NIXL (~3 s of CPU each), which only the prefill and decode need."""
    out = subprocess.run([sys.executable, "-c", CLI], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
