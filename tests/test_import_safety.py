"""Importing kvtransfer, listing connectors and reading a config must stay cheap: no torch, no
gRPC, no UCX (and so no CUDA initialisation) until something that needs them is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

HEAVY = ("torch", "grpc", "ucxx", "numpy")

PROBE = """
import json, sys
import kvtransfer
from kvtransfer import KVConnectorFactory, KVTransferConfig, KVConnectorBase_V1
from kvtransfer.cli import main
KVTransferConfig.from_json('{"kv_connector": "MultiConnector"}')
KVConnectorFactory.discover()
print(json.dumps({m: m in sys.modules for m in %r}))
"""


def test_light_imports_pull_in_no_heavy_module():
    result = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == dict.fromkeys(HEAVY, False)


def test_public_api_names_all_resolve():
    import kvtransfer

    missing = [name for name in kvtransfer.__all__ if not hasattr(kvtransfer, name)]
    assert missing == []


def test_ucx_binding_is_installed_and_importable():
    # The data plane's dependency must install on a CPU-only machine (ucxx-cu12 wheels).
    result = subprocess.run(
        [sys.executable, "-c", "import ucxx; print(ucxx.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("0.")
