"""Regenerate the committed gRPC stubs under ``kvtransfer/v1`` from ``proto/kvtransfer/v1``.

The stubs are committed so installing kvtransfer needs no grpcio-tools; run
``python scripts/codegen.py`` after editing a ``.proto`` and commit the result.
``tests/test_proto_codegen.py`` fails when the committed files drift from the sources.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = Path("kvtransfer") / "v1"


def proto_sources(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The ``.proto`` files, relative to ``proto_root`` (what protoc sees with ``-I proto``)."""
    source_dir = proto_root / PROTO_PACKAGE_DIR
    if not source_dir.is_dir():
        raise FileNotFoundError(
            f"no proto sources at {source_dir}; codegen runs from a source checkout, not from an "
            "installed wheel"
        )
    return sorted(path.relative_to(proto_root) for path in source_dir.glob("*.proto"))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every proto into ``out_dir/kvtransfer/v1``; returns the files written, sorted."""
    from grpc_tools import protoc  # only needed here, so runtime installs can skip grpcio-tools

    out_dir = Path(out_dir)
    sources = proto_sources(proto_root)
    (out_dir / PROTO_PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known_types = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known_types}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(source) for source in sources),
    ]
    # protoc resolves the sources against -I, so the working directory must not matter.
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}: {' '.join(args[1:])}")
    return sorted(
        out_dir / PROTO_PACKAGE_DIR / f"{source.stem}{suffix}"
        for source in sources
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    )


def main() -> int:
    for path in generate(REPO_ROOT):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
