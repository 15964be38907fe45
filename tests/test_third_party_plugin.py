"""The plugin path end to end, for a distribution kvtransfer does not ship.

A sample connector is written as its own distribution, built and installed with pip into a
temporary target directory, and then used from fresh interpreters that only see it through
``PYTHONPATH``: discovery, the CLI, construction from a ``kv_transfer_config``, and the
`kvtransfer.testing` contract suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DIST = "kvt-sample-connector"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "0.3.0"
dependencies = ["kvtransfer"]

[project.entry-points."kvtransfer.connectors"]
SampleConnector = "kvt_sample.connector:SampleConnector"

[tool.setuptools]
packages = ["kvt_sample"]
"""

CONNECTOR = '''
from __future__ import annotations

from kvtransfer import KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorStats


class SampleHandshake(KVConnectorHandshakeMetadata):
    engine_id: str
    num_layers: int


class SampleConnector(KVConnectorBase_V1):
    """Counts the layers it is asked to save; publishes how many layers it owns."""

    handshake_metadata_cls = SampleHandshake

    def __init__(self, config, role, kv_cache_config=None):
        super().__init__(config, role, kv_cache_config)
        self.num_layers = 0
        self.saved_layers = 0

    def register_kv_caches(self, kv_caches):
        self.num_layers = len(kv_caches)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.saved_layers += 1

    def get_handshake_metadata(self):
        return SampleHandshake(
            engine_id=self.kv_transfer_config.engine_id, num_layers=self.num_layers
        )

    def get_kv_connector_stats(self):
        saved, self.saved_layers = self.saved_layers, 0
        return KVConnectorStats(data={"saved_layers": saved}) if saved else None
'''

CONTRACT_TEST = """
import pytest

from kvtransfer import KVTransferConfig
from kvtransfer.testing import KVConnectorContract


class TestSampleConnector(KVConnectorContract):
    @pytest.fixture
    def kv_transfer_config(self):
        return KVTransferConfig(kv_connector="SampleConnector", kv_role="kv_both")
"""

CONSTRUCT = """
from kvtransfer import KVConnectorFactory, KVConnectorRole, KVTransferConfig
from kvtransfer.testing import make_kv_caches

config = KVTransferConfig.from_json('{"kv_connector": "SampleConnector", "kv_role": "kv_both"}')
worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
worker.register_kv_caches(make_kv_caches(num_layers=3))
print(type(worker).__module__, type(worker).__name__, worker.get_handshake_metadata().num_layers)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("plugin")
    source = root / "src"
    (source / "kvt_sample").mkdir(parents=True)
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "kvt_sample" / "__init__.py").write_text("")
    (source / "kvt_sample" / "connector.py").write_text(textwrap.dedent(CONNECTOR))
    tests = root / "sample_tests"
    tests.mkdir()
    (tests / "test_sample_contract.py").write_text(textwrap.dedent(CONTRACT_TEST))
    site = root / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("KVTRANSFER_CONNECTORS_ALLOW", None)
    env.pop("KVTRANSFER_CONNECTORS_DENY", None)
    return root, env


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_cli_lists_the_plugin_with_its_distribution(installed):
    root, env = installed
    result = run(
        [sys.executable, "-m", "kvtransfer.cli", "connectors", "list", "--json"], env, root
    )
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["SampleConnector"] == {
        "name": "SampleConnector",
        "class": "kvt_sample.connector:SampleConnector",
        "distribution": f"{DIST} 0.3.0",
    }
    assert "MultiConnector" in rows


def test_plugin_is_invisible_without_its_distribution(installed):
    root, env = installed
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    result = run(
        [sys.executable, "-m", "kvtransfer.cli", "connectors", "list", "--json"], bare, root
    )
    assert result.returncode == 0, result.stderr
    assert "SampleConnector" not in {row["name"] for row in json.loads(result.stdout)}


def test_plugin_is_constructed_from_a_kv_transfer_config(installed):
    root, env = installed
    result = run([sys.executable, "-c", CONSTRUCT], env, root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["kvt_sample.connector", "SampleConnector", "3"]


def test_plugin_passes_the_contract_suite(installed):
    root, env = installed
    result = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "sample_tests"],
        env,
        root,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "10 passed" in result.stdout


def test_denied_plugin_is_refused_before_import(installed):
    root, env = installed
    check = (
        "import sys\n"
        "from kvtransfer import KVConnectorFactory\n"
        "try:\n"
        "    KVConnectorFactory.get_connector_class_by_name('SampleConnector')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "print('imported' if 'kvt_sample.connector' in sys.modules else 'not imported')\n"
    )
    result = run(
        [sys.executable, "-c", check],
        {**env, "KVTRANSFER_CONNECTORS_DENY": "SampleConnector"},
        root,
    )
    assert result.returncode == 0, result.stderr
    assert "refused: connector 'SampleConnector' is denied" in result.stdout
    assert result.stdout.strip().endswith("not imported")
