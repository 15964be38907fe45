from __future__ import annotations

import pytest

from kvtransfer.connector.factory import KVConnectorFactory


@pytest.fixture(autouse=True)
def _isolated_connector_policy(monkeypatch):
    """Each test starts with no allow/deny list, whatever the environment or a test set."""
    monkeypatch.delenv("KVTRANSFER_CONNECTORS_ALLOW", raising=False)
    monkeypatch.delenv("KVTRANSFER_CONNECTORS_DENY", raising=False)
    KVConnectorFactory.reset_policy()
    KVConnectorFactory.clear_cache()
    yield
    KVConnectorFactory.reset_policy()
    KVConnectorFactory.clear_cache()
