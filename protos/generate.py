"""Regenerate the Python stubs of protos/specserve/v1/*.proto (run: make protos).

The stubs are committed; tests/protos/test_stubs_fresh.py fails when they are stale. protoc writes
imports as ``from specserve.v1 import x_pb2``; inside this distribution the package is
``specserve.protos.specserve.v1``, so the imports are rewritten to be relative.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "specserve" / "v1"
_IMPORT = re.compile(r"^from specserve\.v1 import (\w+) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir (mirroring specserve/v1/) and return the written stub files."""
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = sorted((out_dir / "specserve" / "v1").glob("*_pb2*.py*"))
    for path in written:
        path.write_text(_IMPORT.sub(r"from . import \1 as \2", path.read_text()))
    return written


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = PROTO_DIR / path.name
            target.write_text(path.read_text())
            print(f"wrote {target.relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
