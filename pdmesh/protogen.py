"""Generate the Python gRPC code in pdmesh/v1 from protos/ (the single source of truth).

Run `python -m pdmesh.protogen` after editing a .proto; a test regenerates into a
temporary folder and fails if the committed code is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("pdmesh/v1/*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) over every .proto into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    init = out_dir / "pdmesh" / "v1" / "__init__.py"
    init.write_text('"""Generated from protos/ by `python -m pdmesh.protogen`: do not edit."""\n')


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"generated {len(proto_files())} protos into {args.out / 'pdmesh' / 'v1'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
