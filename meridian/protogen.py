"""Generates the committed Python gRPC stubs in ``meridian/v1`` from ``protos/``.

Run as ``python -m meridian.protogen`` (or ``make protos``). A test regenerates into a
temporary folder and compares, so stubs that drift from the .proto files fail CI.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE = Path("meridian") / "v1"


def proto_files() -> list[Path]:
    """The .proto files of the ``meridian.v1`` API, relative to ``protos/``."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_root/meridian/v1``."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_root.mkdir(parents=True, exist_ok=True)
    files = [str(p) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {files}")
    return sorted((out_root / PROTO_PACKAGE).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write meridian/v1 under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
