"""`RouterConfig`: what the router serves and routes to, checked once (flags or code alike)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtransfer.clients.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    check_max_request_bytes,
    grpc_message_options,
)

_MAX_PORT = 65535
# gRPC waits 1 s, then up to 120 s, between reconnection attempts to a daemon that went away;
# a restarted daemon would stay unreachable that long whatever the health checks say.
_MIN_RECONNECT_BACKOFF_MS = 100


def check_address(address: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too); returns it unchanged or raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= _MAX_PORT:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return address


@dataclass(frozen=True)
class RouterConfig:
    """The daemons to route to and how to serve HTTP.

    ``port`` 0 binds a free port (`RouterServer.port` tells which). ``request_timeout_s`` bounds
    a whole request, prefill and decode together: it becomes the gRPC deadlines.
    ``health_interval_s`` is how often every daemon's health is checked (each check's deadline
    ``health_timeout_s``); an ejected daemon is re-admitted at the first check that finds it
    SERVING. ``release_timeout_s`` is the deadline of a ``ReleaseKV`` call. ``max_request_bytes``
    is the largest HTTP body accepted (413 above it); give the daemons the same value
    (`kvtransfer.clients.limits`). ``shutdown_timeout_s`` is how long in-flight requests may run
    on after a stop. ``tls_ca``/``tls_cert``/``tls_key`` are PEM files; none of them means
    plaintext gRPC. ``kv_stream``: ask prefills to announce their KV while computing it and
    call the decode daemon then (off: the decode is called once the prefill returned).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "builtin"
    request_timeout_s: float = 300.0
    health_timeout_s: float = 1.0
    health_interval_s: float = 1.0
    release_timeout_s: float = 2.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout_s: float = 60.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    kv_stream: bool = True

    def __post_init__(self) -> None:
        # Lists from callers become tuples so the config stays hashable and immutable.
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        for role in ("prefill", "decode"):
            addresses = getattr(self, role)
            if not addresses:
                raise ValueError(f"at least one {role} daemon is required")
            for address in addresses:
                check_address(address)
        if not 0 <= self.port <= _MAX_PORT:
            raise ValueError(f"port must be in [0, {_MAX_PORT}], got {self.port}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        for name in (
            "request_timeout_s",
            "health_timeout_s",
            "health_interval_s",
            "release_timeout_s",
            "shutdown_timeout_s",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        check_max_request_bytes(self.max_request_bytes)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("the TLS certificate and key go together (--tls-cert, --tls-key)")
        for path in (self.tls_ca, self.tls_cert, self.tls_key):
            if path is not None:
                _read_pem(path)

    @property
    def uses_tls(self) -> bool:
        return any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_key))

    def channel_options(self) -> list[tuple[str, int]]:
        """Options of the daemon channels: message limits that fit any accepted body, and
        reconnection attempts at least as often as health checks."""
        backoff_ms = max(_MIN_RECONNECT_BACKOFF_MS, int(self.health_interval_s * 1000))
        return [
            *grpc_message_options(self.max_request_bytes),
            ("grpc.initial_reconnect_backoff_ms", _MIN_RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ]

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for the daemon channels, ``None`` for plaintext."""
        if not self.uses_tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.tls_ca) if self.tls_ca else None,
            private_key=_read_pem(self.tls_key) if self.tls_key else None,
            certificate_chain=_read_pem(self.tls_cert) if self.tls_cert else None,
        )


def _read_pem(path: str) -> bytes:
    # grpc reports a bad file only at the first handshake, as an opaque SSL error: name it now.
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path} is not a PEM file (no '-----BEGIN' line)")
    return data
