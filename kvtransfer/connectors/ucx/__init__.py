"""`UcxConnector`: P/D disaggregation over UCX, with gRPC handshakes and PP x TP-aware pulls.

A producer engine keeps each finished request's prompt KV in its paged cache and serves it;
a consumer engine's workers handshake with it over gRPC and pull exactly the layers, KV heads
and blocks they hold straight into their own paged caches, whatever TP x PP either side runs.
See `kvtransfer.connectors.ucx.connector` for the configuration and protocol.
"""

from __future__ import annotations

from kvtransfer.connectors.ucx.config import UcxConfig
from kvtransfer.connectors.ucx.connector import UcxConnector
from kvtransfer.connectors.ucx.metadata import (
    LoadSpec,
    Release,
    RemotePrefill,
    UcxConnectorMetadata,
    UcxHandshakeMetadata,
    UcxLayer,
)

__all__ = [
    "LoadSpec",
    "Release",
    "RemotePrefill",
    "UcxConfig",
    "UcxConnector",
    "UcxConnectorMetadata",
    "UcxHandshakeMetadata",
    "UcxLayer",
]
