"""Regenerates the checked-in protobuf/gRPC modules from protos/ (run after editing a .proto).

    python -m lowcomm.proto.regenerate [--out DIR]

tests/test_proto_fresh.py regenerates into a temporary folder and fails if the checked-in files differ.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PROTO_FILES = ["lowcomm/proto/wire.proto"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # a build/test dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in PROTO_FILES:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", rel]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repository)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
