"""KV block transfer over UCX (the data plane): pull-based, one message per request chunk.

Importing this package does not initialise UCX; creating a `KVTransferAgent` does.
"""

from __future__ import annotations

from kvtransfer.connector.kv_layout import KV_AXES, canonical_kv_view
from kvtransfer.transport.access import (
    AccessDenied,
    LeaseAccess,
    LeaseGrants,
    LeaseNotGranted,
    WritesStopped,
    new_secret,
    secret_digest,
)
from kvtransfer.transport.agent import KVTransferAgent, PushSession, TransportConfig
from kvtransfer.transport.client import PeerHandle, PullHandle, PullResult
from kvtransfer.transport.errors import (
    CorruptPayloadError,
    EndpointReset,
    ErrorCode,
    InvalidPeerAddress,
    PeerUnreachable,
    RemoteTransferError,
    TransferCancelled,
    TransferTimeoutError,
    TransportClosed,
    TransportError,
)
from kvtransfer.transport.spec import KVLayout, PullSpec

__all__ = [
    "KV_AXES",
    "AccessDenied",
    "CorruptPayloadError",
    "EndpointReset",
    "ErrorCode",
    "InvalidPeerAddress",
    "KVLayout",
    "KVTransferAgent",
    "LeaseAccess",
    "LeaseGrants",
    "LeaseNotGranted",
    "PeerHandle",
    "PeerUnreachable",
    "PullHandle",
    "PullResult",
    "PullSpec",
    "PushSession",
    "RemoteTransferError",
    "TransferCancelled",
    "TransferTimeoutError",
    "TransportClosed",
    "TransportConfig",
    "TransportError",
    "WritesStopped",
    "canonical_kv_view",
    "new_secret",
    "secret_digest",
]
