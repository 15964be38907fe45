"""kvtransfer: prefill/decode disaggregated KV-cache transfer.

The public API is importable from here. Names resolve lazily so that ``import kvtransfer``
(and the CLI) stays fast and never imports torch, gRPC or UCX until a name that needs them is
used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "KVConnectorRole": "kvtransfer.connector.metadata",
    "KVConnectorMetadata": "kvtransfer.connector.metadata",
    "KVCacheLayout": "kvtransfer.connector.metadata",
    "KVConnectorHandshakeMetadata": "kvtransfer.connector.metadata",
    "KVConnectorStats": "kvtransfer.connector.metadata",
    "KVRequest": "kvtransfer.connector.metadata",
    "merge_handshake_metadata": "kvtransfer.connector.metadata",
    "KVConnectorBase_V1": "kvtransfer.connector.base",
    "KVConnectorFactory": "kvtransfer.connector.factory",
    "ConnectorLookupError": "kvtransfer.connector.factory",
    "ConnectorLoadError": "kvtransfer.connector.factory",
    "KVTransferConfig": "kvtransfer.connector.config",
    "KVTransferConfigError": "kvtransfer.connector.config",
    "KVConnectorOutput": "kvtransfer.connector.outputs",
    "ModelRunnerOutput": "kvtransfer.engine.outputs",
    "EMPTY_MODEL_RUNNER_OUTPUT": "kvtransfer.engine.outputs",
    "IntermediateTensors": "kvtransfer.engine.outputs",
    "KVOutputAggregator": "kvtransfer.connector.aggregator",
    "EngineTransferInfo": "kvtransfer.connector.topology",
    "TransferTopology": "kvtransfer.connector.topology",
}

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "ConnectorLoadError",
    "ConnectorLookupError",
    "EngineTransferInfo",
    "IntermediateTensors",
    "KVCacheLayout",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVOutputAggregator",
    "KVRequest",
    "KVTransferConfig",
    "KVTransferConfigError",
    "ModelRunnerOutput",
    "TransferTopology",
    "__version__",
    "merge_handshake_metadata",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from kvtransfer.connector.aggregator import KVOutputAggregator
    from kvtransfer.connector.base import KVConnectorBase_V1
    from kvtransfer.connector.config import KVTransferConfig, KVTransferConfigError
    from kvtransfer.connector.factory import (
        ConnectorLoadError,
        ConnectorLookupError,
        KVConnectorFactory,
    )
    from kvtransfer.connector.metadata import (
        KVCacheLayout,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorStats,
        KVRequest,
        merge_handshake_metadata,
    )
    from kvtransfer.connector.outputs import KVConnectorOutput
    from kvtransfer.connector.topology import EngineTransferInfo, TransferTopology
    from kvtransfer.engine.outputs import (
        EMPTY_MODEL_RUNNER_OUTPUT,
        IntermediateTensors,
        ModelRunnerOutput,
    )
