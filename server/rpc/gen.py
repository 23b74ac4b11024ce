"""Regenerate the gRPC stubs in server/rpc/ from proto/kvserve/v1/generation.proto.

Run as ``python -m server.rpc.gen`` (or ``make proto``). protoc sees ``-I proto`` so the
descriptor keeps its canonical name ``kvserve/v1/generation.proto`` and reflection shows
``kvserve.v1.Generation``; the modules are then written flat into ``server/rpc/`` and the
``_grpc`` module's import is rewritten to ``from server.rpc import generation_pb2``, so the
stubs import as a normal package without touching ``sys.path``.

``tests/server/test_stubs.py`` regenerates into a temporary directory and fails when the
committed stubs differ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "kvserve/v1/generation.proto"
RPC_DIR = Path(__file__).resolve().parent

# protoc's import line in the _grpc module, and what it becomes.
_GRPC_IMPORT = "from kvserve.v1 import generation_pb2 as kvserve_dot_v1_dot_generation__pb2"
_GRPC_IMPORT_FIXED = "from server.rpc import generation_pb2 as kvserve_dot_v1_dot_generation__pb2"
# The module name protoc records for the message classes (their __module__, used by pickle).
_PB2_MODULE = "'kvserve.v1.generation_pb2'"
_PB2_MODULE_FIXED = "'server.rpc.generation_pb2'"

GENERATED_FILES = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def _replace_once(text: str, old: str, new: str, name: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"protoc output changed: expected {old!r} once in {name}")
    return text.replace(old, new)


def generate(out_dir: Path) -> list[Path]:
    """Write the three stub files into ``out_dir``; returns their paths. Raises on protoc errors."""
    from grpc_tools import protoc  # dev dependency: imported only when generating

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        src_dir = Path(tmp) / "kvserve" / "v1"
        written = []
        for name in GENERATED_FILES:
            text = (src_dir / name).read_text()
            if name == "generation_pb2_grpc.py":
                text = _replace_once(text, _GRPC_IMPORT, _GRPC_IMPORT_FIXED, name)
            elif name == "generation_pb2.py":
                text = _replace_once(text, _PB2_MODULE, _PB2_MODULE_FIXED, name)
            dst = out_dir / name
            dst.write_text(text)
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=RPC_DIR, help="output directory (default: server/rpc)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
