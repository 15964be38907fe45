"""Clients of every gRPC service kvtransfer serves: KVHandshake and KVAdmin (`control`, served by
each connector's and daemon's control server) and Generation (`generation`, served by the
daemons). The router, the connectors, the CLI and the tests all talk through these."""

from kvtransfer.clients.control import (
    AdminClient,
    HandshakeClient,
    check_health,
    close_all,
    get_handshake_client,
    wait_until_serving,
)
from kvtransfer.clients.generation import GenerateResult, GenerationClient, generate_request

__all__ = [
    "AdminClient",
    "GenerateResult",
    "GenerationClient",
    "HandshakeClient",
    "check_health",
    "close_all",
    "generate_request",
    "get_handshake_client",
    "wait_until_serving",
]
