"""TLS/mTLS for every gRPC server and client, and the shared admin token that guards KVAdmin.

A server given `TLSFiles` with a ``ca_file`` requires client certificates (mTLS). The admin
token guards only KVAdmin: health, reflection, handshakes and Generation stay reachable by
whoever can reach the port (protect those with TLS and the network).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ADMIN_TOKEN_METADATA_KEY = "authorization"


@dataclass(frozen=True)
class TLSFiles:
    """PEM files. ``cert_file``/``key_file``: our certificate chain and key (required on a
    server; on a client they enable mTLS). ``ca_file``: on a server, the CA client certificates
    must chain to (clients must present one); on a client, the CA that verifies the server.
    ``server_name``: client only, the name the server certificate must carry when it differs
    from the dialled host."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls cert_file and key_file must be given together")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls {name} {path!r} does not exist")

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path is not None else None


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("a TLS server needs cert_file and key_file")
    return grpc.ssl_server_credentials(
        [(tls.read("key_file"), tls.read("cert_file"))],
        root_certificates=tls.read("ca_file"),
        require_client_auth=tls.ca_file is not None,
    )


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.read("ca_file"),
        private_key=tls.read("key_file"),
        certificate_chain=tls.read("cert_file"),
    )


def channel_options(tls: TLSFiles | None) -> list[tuple[str, str]]:
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def admin_token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((ADMIN_TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to ``service`` without ``authorization: Bearer <token>`` (UNAUTHENTICATED)."""

    def __init__(self, service: str, token: str) -> None:
        if not token:
            raise ValueError("the admin token must not be empty")
        self._prefix = f"/{service}/"
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not handler_call_details.method.startswith(self._prefix):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(ADMIN_TOKEN_METADATA_KEY)
        if given is None:
            return _deny("missing admin token (authorization: Bearer <token>)")
        if not hmac.compare_digest(str(given).encode(), self._expected):
            return _deny("wrong admin token")
        return await continuation(handler_call_details)


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)
