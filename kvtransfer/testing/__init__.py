"""Helpers for connector authors: the contract suite and small builders.

Run the contract against your connector by subclassing `KVConnectorContract` in a test module
and providing a ``kv_transfer_config`` fixture::

    from kvtransfer import KVTransferConfig
    from kvtransfer.testing import KVConnectorContract

    class TestMyConnector(KVConnectorContract):
        @pytest.fixture
        def kv_transfer_config(self):
            return KVTransferConfig(kv_connector="MyConnector", kv_role="kv_both")
"""

from __future__ import annotations

from kvtransfer.testing.builders import (
    ContractRequest,
    ContractSchedulerOutput,
    make_kv_caches,
    make_request,
)
from kvtransfer.testing.contract import KVConnectorContract
from kvtransfer.testing.recording import RecordingConnector

__all__ = [
    "ContractRequest",
    "ContractSchedulerOutput",
    "KVConnectorContract",
    "RecordingConnector",
    "make_kv_caches",
    "make_request",
]
