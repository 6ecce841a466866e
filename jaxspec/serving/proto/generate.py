"""Regenerate the Python modules of the serving protos with grpcio-tools.

    python jaxspec/serving/proto/generate.py            # rewrite the committed modules in place
    python jaxspec/serving/proto/generate.py --out DIR  # write them under DIR (the freshness test does this)

protoc runs with `-I jaxspec/serving/proto`, so descriptors keep their canonical names
(`jaxspec/v1/generation.proto`, what reflection shows). protoc writes the gRPC module's import of
its messages as `from jaxspec.v1 import ...`, which would resolve to this repository's `jaxspec`
package; that one line is rewritten to the real module path `jaxspec.serving.proto.jaxspec.v1`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTOS = ("jaxspec/v1/generation.proto",)
PYTHON_PACKAGE = "jaxspec.serving.proto"  # the Python package PROTO_ROOT is importable as


def generated_files(proto: str) -> tuple[str, ...]:
    """The module paths (relative to PROTO_ROOT) generated from one proto."""
    stem = proto[: -len(".proto")]
    return f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc over every proto into `out_dir`; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc  # lazy: only needed to regenerate

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    written = []
    for proto in PROTOS:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
                          f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(PROTO_ROOT / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        for name in generated_files(proto):
            path = out_dir / name
            if name.endswith("_grpc.py"):
                _fix_imports(path)
            written.append(path)
    return written


def _fix_imports(path: Path) -> None:
    """`from jaxspec.v1 import x_pb2` -> `from jaxspec.serving.proto.jaxspec.v1 import x_pb2`."""
    text = path.read_text()
    fixed, n = re.subn(r"^from (jaxspec\.v\d+) import ", rf"from {PYTHON_PACKAGE}.\1 import ", text, flags=re.M)
    if n == 0:
        raise RuntimeError(f"{path}: no message import to rewrite (protoc output changed?)")
    path.write_text(fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: next to the protos)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
