"""Generate the Python gRPC code for proto/ into client/weightstream/v1 (or into another folder, for checks)."""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = pathlib.PurePosixPath("weightstream/v1")
DEFAULT_OUT = ROOT / "client" / "weightstream" / "v1"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compile every .proto of weightstream/v1 and copy the generated modules into out_dir."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted((pathlib.Path(tmp) / PACKAGE_DIR).iterdir()):
            target = out_dir / path.name
            shutil.copyfile(path, target)
            written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
