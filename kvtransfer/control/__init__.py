"""The gRPC control plane: handshake metadata exchange (`KVHandshake`) and admin (`KVAdmin`).

KV bytes never cross it; it only tells a decode engine where a prefill engine's workers keep
their KV cache and whether the two engines are compatible.
"""

from kvtransfer.control.admin import (
    AdminBackend,
    BasicAdminBackend,
    EngineStatus,
    HandshakeState,
    PeerInfo,
    TransferDirection,
    TransferInfo,
)
from kvtransfer.control.book import HandshakeBook
from kvtransfer.control.client import (
    AdminClient,
    ClientCache,
    FetchedHandshake,
    HandshakeClient,
    RetryPolicy,
    check_health,
    close_all,
    fetch_handshake_sync,
    get_handshake_client,
    wait_until_serving,
)
from kvtransfer.control.compat import API_VERSION, CompatibilityInfo, FieldDifference
from kvtransfer.control.errors import (
    AdminAuthError,
    ControlPlaneError,
    EngineIdMismatchError,
    HandshakeCompatibilityError,
    HandshakeNotFoundError,
    HandshakePayloadError,
    InvalidArgumentError,
    PeerUnavailableError,
    RemoteCallError,
)
from kvtransfer.control.security import TLSFiles
from kvtransfer.control.server import ControlServer, ControlServerThread, start_control_server

__all__ = [
    "API_VERSION",
    "AdminAuthError",
    "AdminBackend",
    "AdminClient",
    "BasicAdminBackend",
    "ClientCache",
    "CompatibilityInfo",
    "ControlPlaneError",
    "ControlServer",
    "ControlServerThread",
    "EngineIdMismatchError",
    "EngineStatus",
    "FetchedHandshake",
    "FieldDifference",
    "HandshakeBook",
    "HandshakeClient",
    "HandshakeCompatibilityError",
    "HandshakeNotFoundError",
    "HandshakePayloadError",
    "HandshakeState",
    "InvalidArgumentError",
    "PeerInfo",
    "PeerUnavailableError",
    "RemoteCallError",
    "RetryPolicy",
    "TLSFiles",
    "TransferDirection",
    "TransferInfo",
    "check_health",
    "close_all",
    "fetch_handshake_sync",
    "get_handshake_client",
    "start_control_server",
    "wait_until_serving",
]
