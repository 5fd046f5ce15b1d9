"""Regenerate the checked-in gRPC code: ``python -m resihp.proto.regen``.

protoc writes imports after the path the .proto had under its include root, so the file
is staged at ``resihp/proto/resihp.proto`` in a temporary tree: the generated
``resihp_pb2_grpc.py`` then reads ``from resihp.proto import resihp_pb2``, which works
once the package is installed as ``resihp.proto``. ``--check`` regenerates into a
temporary directory and reports any difference instead of writing.
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "resihp.proto"
OUTPUTS = ("resihp_pb2.py", "resihp_pb2.pyi", "resihp_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Generate the Python modules for ``proto/resihp.proto`` into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency; imported lazily

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="resihp-proto-") as tmp:
        stage = Path(tmp) / "src"
        (stage / "resihp" / "proto").mkdir(parents=True)
        shutil.copy(HERE / PROTO, stage / "resihp" / "proto" / PROTO)
        gen = Path(tmp) / "gen"
        gen.mkdir()
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{stage}", f"--python_out={gen}", f"--pyi_out={gen}",
            f"--grpc_python_out={gen}", f"resihp/proto/{PROTO}",
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit status {rc} on {HERE / PROTO}")
        written = []
        for name in OUTPUTS:
            shutil.copy(gen / "resihp" / "proto" / name, out_dir / name)
            written.append(out_dir / name)
        return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resihp.proto.regen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare with the checked-in files; write nothing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(HERE):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in OUTPUTS if not (HERE / n).exists() or not filecmp.cmp(Path(tmp) / n, HERE / n, shallow=False)]
    if stale:
        print(f"stale generated files: {stale}; run 'python -m resihp.proto.regen'", file=sys.stderr)
        return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
