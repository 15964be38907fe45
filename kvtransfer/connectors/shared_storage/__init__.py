"""`SharedStorageConnector`: P/D disaggregation through a shared directory.

A producer engine writes each finished request's prompt KV, one safetensors file per worker;
a consumer engine loads it into its own paged cache, whatever TP/PP split either side runs.
See `kvtransfer.connectors.shared_storage.connector` for the configuration and protocol.
"""

from __future__ import annotations

from kvtransfer.connectors.shared_storage.connector import SharedStorageConnector
from kvtransfer.connectors.shared_storage.metadata import (
    LoadSpec,
    RemotePrefill,
    SaveSpec,
    SharedStorageConnectorMetadata,
    SharedStorageHandshakeMetadata,
)
from kvtransfer.connectors.shared_storage.storage import SharedStorageConfig

__all__ = [
    "LoadSpec",
    "RemotePrefill",
    "SaveSpec",
    "SharedStorageConfig",
    "SharedStorageConnector",
    "SharedStorageConnectorMetadata",
    "SharedStorageHandshakeMetadata",
]
