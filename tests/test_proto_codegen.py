"""The committed stubs under kvtransfer/v1 are exactly what the proto sources generate, and the
dependency floors in pyproject.toml admit them."""

from __future__ import annotations

import importlib
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from script_modules import load_script

pytestmark = pytest.mark.unit

codegen = load_script("codegen")

REPO_ROOT = Path(__file__).resolve().parents[1]
STUB_DIR = REPO_ROOT / "kvtransfer" / "v1"
STUB_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _floor(requirement_name: str) -> tuple[int, ...]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    for requirement in pyproject["project"]["dependencies"]:
        match = re.fullmatch(rf"{re.escape(requirement_name)}\s*>=\s*([\d.]+)(.*)", requirement)
        if match:
            return _version(match.group(1))
    raise AssertionError(f"no {requirement_name}>= floor in pyproject.toml")


def _committed() -> dict[str, bytes]:
    paths = sorted(p for pattern in STUB_GLOBS for p in STUB_DIR.glob(pattern))
    return {p.name: p.read_bytes() for p in paths}


def test_regenerated_stubs_equal_the_committed_ones(tmp_path):
    generated = codegen.generate(tmp_path)
    assert {p.name: p.read_bytes() for p in generated} == _committed()
    assert (STUB_DIR / "__init__.py").exists()


def test_generated_modules_import_each_other_absolutely():
    for name, text in _committed().items():
        if name.endswith("_grpc.py"):
            assert re.search(rb"^from kvtransfer\.v1 import \w+_pb2 as ", text, re.M), name


@pytest.mark.parametrize("module", ["handshake_pb2_grpc", "admin_pb2_grpc"])
def test_grpc_generated_version_is_within_the_grpcio_floor(module):
    generated = _version(importlib.import_module(f"kvtransfer.v1.{module}").GRPC_GENERATED_VERSION)
    assert generated <= _version(version("grpcio"))
    assert generated == _floor("grpcio")
    # Health and reflection ship in lockstep with grpcio.
    assert _floor("grpcio-health-checking") == _floor("grpcio-reflection") == generated


@pytest.mark.parametrize("module", ["handshake_pb2", "admin_pb2"])
def test_protobuf_gencode_version_is_within_the_protobuf_range(module):
    text = (STUB_DIR / f"{module}.py").read_text()
    match = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", text)
    assert match, f"{module}.py carries no gencode version check"
    gencode = tuple(int(group) for group in match.groups())
    assert gencode <= _version(version("protobuf"))
    assert gencode == _floor("protobuf")
    # The runtime refuses gencode of another major version, hence the <major+1 cap.
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    [protobuf] = [d for d in pyproject["project"]["dependencies"] if d.startswith("protobuf")]
    assert f"<{gencode[0] + 1}" in protobuf.replace(" ", "")


def test_protos_declare_the_package_their_path_mirrors():
    for source in codegen.proto_sources():
        text = (codegen.PROTO_ROOT / source).read_text()
        assert "package kvtransfer.v1;" in text
        assert source.parent == Path("kvtransfer/v1")
