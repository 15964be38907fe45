"""TLS/mTLS for control-plane gRPC servers and clients, and the admin token that guards KVAdmin.

A server given `TLSFiles` with a ``ca_file`` requires client certificates (mTLS). The admin
token guards only KVAdmin: health, reflection, handshakes and any extra services (e.g.
Generation) stay reachable by whoever can reach the port; protect those with TLS and the
network.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc

ADMIN_TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer"
_FILE_FIELDS = ("cert_file", "key_file", "ca_file")


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for one side of a TLS connection.

    ``cert_file``/``key_file``: our certificate chain and its private key (required on a
    server; on a client they are the client certificate for mTLS). ``ca_file``: on a server,
    the CA client certificates must chain to (clients must then present one: mTLS); on a
    client, the CA that verifies the server (``None``: the system roots). ``server_name``:
    client only, the name the server certificate must carry when it differs from the dialled
    host (e.g. certificates issued for "localhost" while dialling 127.0.0.1).

    Frozen and hashable, so client caches can key channels by it.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"TLSFiles.{spec.name} must be a str, got {value!r}")
            if not value.strip():
                raise ValueError(f"TLSFiles.{spec.name} must not be empty (leave it None)")
        if self.cert_file is not None and self.key_file is None:
            raise ValueError("TLSFiles.key_file is required when cert_file is set")
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("TLSFiles.cert_file is required when key_file is set")
        for name in _FILE_FIELDS:
            _check_pem(name, getattr(self, name))


def _check_pem(name: str, path: str | None) -> None:
    # grpc reports a bad file only at the first handshake, as an opaque SSL error; name it now.
    if path is None:
        return
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"TLSFiles.{name}: {path!r} does not exist or is not a file")
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"TLSFiles.{name}: cannot read {path!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in text:
        raise ValueError(f"TLSFiles.{name}: {path!r} is not PEM (no '-----BEGIN' line)")


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server-side credentials; a ``ca_file`` makes client certificates required (mTLS)."""
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("TLSFiles.cert_file and key_file are required on a server")
    if tls.server_name is not None:
        raise ValueError("TLSFiles.server_name is for clients; a server does not use it")
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file),
        require_client_auth=tls.ca_file is not None,
    )


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    """Client-side credentials: verify the server with ``ca_file`` (system roots when unset)
    and present ``cert_file``/``key_file`` when set (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file),
        certificate_chain=_read(tls.cert_file),
    )


def channel_options(tls: TLSFiles | None) -> list[tuple[str, str]]:
    """Channel options ``tls`` needs: the target-name override when ``server_name`` is set."""
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def admin_token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (``()`` for ``None``)."""
    if token is None:
        return ()
    _check_token(token)
    return ((ADMIN_TOKEN_METADATA_KEY, f"{_BEARER} {token}"),)


def _check_token(token: str) -> None:
    # gRPC metadata values are printable ASCII; a space would break "Bearer <token>" parsing.
    if not isinstance(token, str) or not token:
        raise ValueError("the admin token must be a non-empty str")
    if not all("!" <= char <= "~" for char in token):
        raise ValueError("the admin token must be printable ASCII without spaces")


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call of ``service`` that lacks
    ``authorization: Bearer <token>``; calls to other services pass untouched."""

    def __init__(self, service: str, token: str) -> None:
        _check_token(token)
        self._prefix = f"/{service}/"
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        problem = self._problem(handler_call_details.invocation_metadata)
        return handler if problem is None else _deny(handler, problem)

    def _problem(self, metadata: Any) -> str | None:
        values = [value for key, value in metadata or () if key == ADMIN_TOKEN_METADATA_KEY]
        if not values:
            return f"missing admin token (send '{ADMIN_TOKEN_METADATA_KEY}: Bearer <token>')"
        value = values[-1]
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        scheme, _, given = text.partition(" ")
        # Compare even a malformed value in constant time: no hint from response timing.
        matches = hmac.compare_digest(given.strip().encode("utf-8", "replace"), self._expected)
        if scheme.lower() != _BEARER.lower() or not matches:
            return "wrong admin token"
        return None


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    shape = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[shape]
    return make(
        abort,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
