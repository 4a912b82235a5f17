"""Generates the committed Python gRPC stubs in ``meridian/v1`` from ``protos/``.

Run as ``python -m meridian.protogen`` (or ``make protos``). A test regenerates into a
temporary folder and compares, so stubs that drift from the .proto files fail CI.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

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


def descriptor_set(
    proto_root: Path = PROTO_ROOT, files: list[Path] | None = None, *, source_info: bool = True
) -> descriptor_pb2.FileDescriptorSet:
    """Compiles .proto files (relative to ``proto_root``; default: the ``meridian.v1`` API)
    into a FileDescriptorSet with their imports. ``source_info`` keeps each element's
    location and comments: the API reference renders them and the compatibility check
    reports lines with them."""
    import tempfile

    from grpc_tools import protoc  # dev dependency: only needed to compile

    names = [str(p) for p in (files if files is not None else proto_files())]
    with tempfile.TemporaryDirectory(prefix="meridian-protos-") as tmp:
        out = Path(tmp) / "set.binpb"
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"--descriptor_set_out={out}", "--include_imports"]
        args += ["--include_source_info"] if source_info else []
        if protoc.main([*args, *names]) != 0:
            raise RuntimeError(f"protoc failed for {names} under {proto_root} (its errors are above)")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def source_locations(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], descriptor_pb2.SourceCodeInfo.Location]:
    """Each element's location (span and comments) in ``file``, by its descriptor path
    (e.g. ``(4, 0, 2, 1)``: message 0, field 1); empty without source info."""
    return {tuple(loc.path): loc for loc in file.source_code_info.location}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write meridian/v1 under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
