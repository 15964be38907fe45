from __future__ import annotations

import sys
import textwrap

import pytest

from kvtransfer import (
    ConnectorLoadError,
    ConnectorLookupError,
    KVConnectorFactory,
    KVConnectorRole,
    KVTransferConfig,
)
from kvtransfer.cli import main as cli_main
from kvtransfer.connectors.multi import MultiConnector
from kvtransfer.testing.recording import RecordingConnector

pytestmark = pytest.mark.unit

CONNECTOR_SOURCE = """
from kvtransfer import KVConnectorBase_V1

class {cls}(KVConnectorBase_V1):
    pass
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where tests drop installed-looking distributions."""
    monkeypatch.syspath_prepend(str(tmp_path))
    added_modules: list[str] = []

    def install(dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
        info = tmp_path / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
        (info / "entry_points.txt").write_text(f"[kvtransfer.connectors]\n{lines}\n")
        for module, source in modules.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            added_modules.append(module)

    yield install
    for module in added_modules:
        sys.modules.pop(module, None)


def test_first_party_connector_is_registered_through_entry_points():
    found = KVConnectorFactory.discover()
    assert [e.value for e in found["MultiConnector"]] == [
        "kvtransfer.connectors.multi:MultiConnector"
    ]
    assert found["MultiConnector"][0].distribution.startswith("kvtransfer ")
    assert KVConnectorFactory.get_connector_class_by_name("MultiConnector") is MultiConnector


def test_discovery_imports_nothing_and_lookup_imports_only_the_chosen(site):
    site(
        "plug-a",
        {"PlugA": "plug_a_mod:PlugA"},
        {"plug_a_mod": CONNECTOR_SOURCE.format(cls="PlugA")},
    )
    site(
        "plug-b",
        {"PlugB": "plug_b_mod:PlugB"},
        {"plug_b_mod": CONNECTOR_SOURCE.format(cls="PlugB")},
    )
    found = KVConnectorFactory.discover()
    assert {"PlugA", "PlugB"} <= set(found)
    assert "plug_a_mod" not in sys.modules and "plug_b_mod" not in sys.modules
    cls = KVConnectorFactory.get_connector_class_by_name("PlugA")
    assert cls.__name__ == "PlugA" and "plug_a_mod" in sys.modules
    assert "plug_b_mod" not in sys.modules
    assert KVConnectorFactory.get_connector_class_by_name("PlugA") is cls  # idempotent


def test_create_connector_builds_the_role(site):
    site(
        "plug-a",
        {"PlugA": "plug_a_mod:PlugA"},
        {"plug_a_mod": CONNECTOR_SOURCE.format(cls="PlugA")},
    )
    config = KVTransferConfig(kv_connector="PlugA", kv_role="kv_both")
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
    assert type(connector).__name__ == "PlugA"
    assert connector.role is KVConnectorRole.WORKER and connector.kv_transfer_config is config


def test_unknown_name_lists_what_is_registered():
    with pytest.raises(ConnectorLookupError, match=r"unknown KV connector 'Nope'.*MultiConnector"):
        KVConnectorFactory.get_connector_class_by_name("Nope")


def test_config_without_connector():
    with pytest.raises(ConnectorLookupError, match="kv_connector is not set"):
        KVConnectorFactory.create_connector(KVTransferConfig(), KVConnectorRole.WORKER)


def test_duplicate_name_names_both_distributions(site):
    site("dup-one", {"Twin": "twin_one:Twin"}, {"twin_one": CONNECTOR_SOURCE.format(cls="Twin")})
    site("dup-two", {"Twin": "twin_two:Twin"}, {"twin_two": CONNECTOR_SOURCE.format(cls="Twin")})
    with pytest.raises(ConnectorLookupError, match="registered twice") as info:
        KVConnectorFactory.get_connector_class_by_name("Twin")
    assert "dup-one 1.2.3" in str(info.value) and "dup-two 1.2.3" in str(info.value)
    assert "twin_one" not in sys.modules and "twin_two" not in sys.modules


def test_broken_plugin_names_its_distribution(site):
    site(
        "broken-dist",
        {"Broken": "broken_mod:Broken"},
        {"broken_mod": "import no_such_dependency\n"},
    )
    with pytest.raises(
        ConnectorLoadError, match=r"from distribution broken-dist 1.2.3 failed"
    ) as info:
        KVConnectorFactory.get_connector_class_by_name("Broken")
    assert "no_such_dependency" in str(info.value)


def test_entry_point_that_is_not_a_connector(site):
    site("odd-dist", {"Odd": "odd_mod:Odd"}, {"odd_mod": "class Odd:\n    pass\n"})
    with pytest.raises(ConnectorLookupError, match=r"odd_mod:Odd from odd-dist 1.2.3 is not a"):
        KVConnectorFactory.get_connector_class_by_name("Odd")


def test_deny_is_checked_before_import(site, monkeypatch):
    site(
        "plug-a",
        {"PlugA": "plug_a_mod:PlugA"},
        {"plug_a_mod": CONNECTOR_SOURCE.format(cls="PlugA")},
    )
    monkeypatch.setenv("KVTRANSFER_CONNECTORS_DENY", "Other, PlugA")
    with pytest.raises(ConnectorLookupError, match="'PlugA' is denied"):
        KVConnectorFactory.get_connector_class_by_name("PlugA")
    assert "plug_a_mod" not in sys.modules


def test_allow_list_is_checked_before_import(site):
    site(
        "plug-a",
        {"PlugA": "plug_a_mod:PlugA"},
        {"plug_a_mod": CONNECTOR_SOURCE.format(cls="PlugA")},
    )
    KVConnectorFactory.set_policy(allow={"MultiConnector"})
    with pytest.raises(ConnectorLookupError, match="'PlugA' is not in the connector allow list"):
        KVConnectorFactory.get_connector_class_by_name("PlugA")
    assert "plug_a_mod" not in sys.modules
    assert KVConnectorFactory.get_connector_class_by_name("MultiConnector") is MultiConnector


def test_policy_also_guards_module_path():
    KVConnectorFactory.set_policy(deny={"RecordingConnector"})
    config = KVTransferConfig(
        kv_connector="RecordingConnector", kv_connector_module_path="kvtransfer.testing.recording"
    )
    with pytest.raises(ConnectorLookupError, match="denied"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)


def test_module_path_takes_precedence_over_entry_points(site):
    # An entry point named RecordingConnector exists, but the module path wins.
    site(
        "shadow",
        {"RecordingConnector": "shadow_mod:RecordingConnector"},
        {"shadow_mod": "raise RuntimeError('must not import')\n"},
    )
    config = KVTransferConfig(
        kv_connector="RecordingConnector", kv_connector_module_path="kvtransfer.testing.recording"
    )
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
    assert type(connector) is RecordingConnector
    assert "shadow_mod" not in sys.modules


def test_module_path_errors():
    missing_module = KVTransferConfig(kv_connector="X", kv_connector_module_path="no.such.module")
    with pytest.raises(ConnectorLoadError, match=r"'no.such.module' failed to import"):
        KVConnectorFactory.create_connector(missing_module, KVConnectorRole.WORKER)
    missing_class = KVTransferConfig(
        kv_connector="Nope", kv_connector_module_path="kvtransfer.testing.recording"
    )
    with pytest.raises(ConnectorLookupError, match="has no connector class 'Nope'"):
        KVConnectorFactory.create_connector(missing_class, KVConnectorRole.WORKER)
    not_connector = KVTransferConfig(
        kv_connector="make_request", kv_connector_module_path="kvtransfer.testing.builders"
    )
    with pytest.raises(ConnectorLookupError, match="not a KVConnectorBase_V1 subclass"):
        KVConnectorFactory.create_connector(not_connector, KVConnectorRole.WORKER)


def test_cli_lists_name_class_and_distribution(site, capsys):
    site(
        "plug-a",
        {"PlugA": "plug_a_mod:PlugA"},
        {"plug_a_mod": CONNECTOR_SOURCE.format(cls="PlugA")},
    )
    site("dup-one", {"Twin": "twin_one:Twin"}, {})
    site("dup-two", {"Twin": "twin_two:Twin"}, {})
    assert cli_main(["connectors", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "class", "distribution"]
    assert any(
        line.split()[:4] == ["PlugA", "plug_a_mod:PlugA", "plug-a", "1.2.3"] for line in lines
    )
    assert any(line.startswith("MultiConnector") and "kvtransfer" in line for line in lines)
    assert sum("CONFLICT" in line for line in lines) == 2
    assert "plug_a_mod" not in sys.modules


def test_cli_json(capsys):
    import json

    assert cli_main(["connectors", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {
        "name": "MultiConnector",
        "class": "kvtransfer.connectors.multi:MultiConnector",
    }.items() <= rows[[r["name"] for r in rows].index("MultiConnector")].items()
