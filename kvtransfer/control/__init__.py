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
    "BasicAdminBackend",
    "CompatibilityInfo",
    "ControlPlaneError",
    "ControlServer",
    "ControlServerThread",
    "EngineIdMismatchError",
    "EngineStatus",
    "FieldDifference",
    "HandshakeBook",
    "HandshakeCompatibilityError",
    "HandshakeNotFoundError",
    "HandshakePayloadError",
    "HandshakeState",
    "InvalidArgumentError",
    "PeerInfo",
    "PeerUnavailableError",
    "RemoteCallError",
    "TLSFiles",
    "TransferDirection",
    "TransferInfo",
    "start_control_server",
]
