"""`UcxConfig`: the `UcxConnector`'s settings, read from a `KVTransferConfig` and checked.

``kv_ip``/``kv_port`` (vLLM's top-level keys) say where a producer serves its handshake; the
connector's own keys live in ``kv_connector_extra_config``.

TLS for that port (handshakes and completion messages; the UCX data plane stays as it is):
``tls_cert_file``/``tls_key_file`` are a producer's certificate and key (on a consumer: its
client certificate for mTLS), ``tls_ca_file`` the CA a producer requires client certificates
to chain to (mTLS) and the CA a consumer verifies producers with, ``tls_server_name`` the name
a consumer expects on producer certificates when it differs from the dialled host. Any of them
turns TLS on; an engine that produces then needs a certificate and key.

UCX is confined to the interface that carries KV traffic (see `kvtransfer.transport.netdev`):
``kv_net_device`` names it (UCX device names, comma-separated), else ``UCX_NET_DEVICES``, else
the interface holding ``kv_ip`` (on a consumer too: its own KV address).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.control.security import TLSFiles
from kvtransfer.transport.netdev import kv_net_devices

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
# Long enough to ride out a consumer whose keep-alives stall: on an oversubscribed 2-core host a
# TP 2 vLLM decode's first gRPC connection to its producer took 20-30 s (gRPC's 20 s connect
# timeout, then a retry), and a 30 s lease expired under a live consumer. vLLM's NIXL waits 480 s.
DEFAULT_LEASE_S = 120.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONCURRENT_LOADS = 4

_SECONDS_KEYS = ("kv_lease_s", "transfer_timeout_s", "handshake_timeout_s")
# kv_connector_extra_config key -> TLSFiles field.
_TLS_KEYS = {
    "tls_cert_file": "cert_file",
    "tls_key_file": "key_file",
    "tls_ca_file": "ca_file",
    "tls_server_name": "server_name",
}
_EXTRA_KEYS = (
    *_SECONDS_KEYS,
    "max_concurrent_loads",
    "kv_net_device",
    "kv_payload_checksum",
    "kv_stream_min_tokens",
    "data_plane",
    *_TLS_KEYS,
)
# "rma": one-sided reads of the producer's registered KV (the producer runs no code per read);
# "tagged": every read is a request the producer checks against the lease; "push": the consumer
# grants its blocks and the producer writes each layer into them once computed (a producer
# serves rma reads too). See docs/data-plane.md#security-per-mode.
DATA_PLANES = ("rma", "tagged", "push")
DEFAULT_DATA_PLANE = "rma"
# Shorter prompts are not streamed: their compute is too short for the transfer to hide behind,
# and serving pulls while computing slows the prefill (measured on 2 vCPUs: +5-15 ms TTFT).
DEFAULT_KV_STREAM_MIN_TOKENS = 256


@dataclass(frozen=True)
class UcxConfig:
    """``lease_s``: how long a producer keeps a finished request's blocks for a consumer that
    has not pulled them (consumers extend it while they wait). ``transfer_timeout_s`` bounds one
    request's pulls, ``handshake_timeout_s`` one handshake attempt (two are made) and one UCX
    connect. ``tls``: see the module docstring; ``None`` is plaintext. ``net_device``: UCX
    network devices for KV traffic (``kv_net_device``); ``None`` derives them.
    ``payload_checksum``: a producer's payloads carry their xxh3-64, which consumers check
    (``kv_payload_checksum``; off by default: it cost 11-34% of pull throughput in
    ``benchmarks/transfer.py --checksum-cost`` on a 2-vCPU VM). ``stream_min_tokens``: a
    producer streams (``kv_stream``) only prompts of at least this many tokens
    (``kv_stream_min_tokens``); shorter ones hand over once computed. ``data_plane``: ``"rma"``
    (one-sided reads; a producer offers them, a consumer uses them where offered) or
    ``"tagged"`` (every read checked by the producer) or ``"push"`` (a consumer grants its
    blocks to producers that offer pushes, which write each layer once computed; it pulls from
    the others, and a push producer serves one-sided reads too)."""

    host: str = DEFAULT_HOST
    port: int = 0
    lease_s: float = DEFAULT_LEASE_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    max_concurrent_loads: int = DEFAULT_MAX_CONCURRENT_LOADS
    tls: TLSFiles | None = None
    net_device: str | None = None
    payload_checksum: bool = False
    stream_min_tokens: int = DEFAULT_KV_STREAM_MIN_TOKENS
    data_plane: str = DEFAULT_DATA_PLANE

    @property
    def server_tls(self) -> TLSFiles | None:
        """What the producer's handshake server uses (a client-only setting dropped)."""
        return None if self.tls is None else replace(self.tls, server_name=None)

    def ucx_net_devices(self) -> str | None:
        """The UCX network devices of this host's KV traffic (``None``: ``UCX_NET_DEVICES``).

        `ValueError` naming ``kv_ip`` when no interface here holds it."""
        chosen = kv_net_devices(self.host, self.net_device)
        logger.info(
            "UCX network devices for KV traffic: %s (from %s)",
            chosen.devices or "as set",
            chosen.source,
        )
        return chosen.devices

    @classmethod
    def from_transfer_config(cls, config: KVTransferConfig) -> UcxConfig:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(
                f"UcxConnector: unknown kv_connector_extra_config key(s) {unknown}; known keys "
                f"are {list(_EXTRA_KEYS)}"
            )
        defaults = cls()
        return cls(
            host=config.kv_ip or DEFAULT_HOST,
            port=config.kv_port or 0,
            lease_s=_seconds(extra, "kv_lease_s", defaults.lease_s),
            transfer_timeout_s=_seconds(extra, "transfer_timeout_s", defaults.transfer_timeout_s),
            handshake_timeout_s=_seconds(
                extra, "handshake_timeout_s", defaults.handshake_timeout_s
            ),
            max_concurrent_loads=_count(
                extra, "max_concurrent_loads", defaults.max_concurrent_loads
            ),
            tls=_tls(extra, serves=config.is_kv_producer),
            net_device=_net_device(extra),
            payload_checksum=_flag(extra, "kv_payload_checksum", defaults.payload_checksum),
            stream_min_tokens=_tokens(extra, "kv_stream_min_tokens", defaults.stream_min_tokens),
            data_plane=_data_plane(extra),
        )


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config.{key} must be true or false, got {value!r}")
    return value


def _count(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_connector_extra_config.{key} must be an int >= 1, got {value!r}")
    return value


def _tokens(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be an int >= 0, got {value!r}")
    return value


def _data_plane(extra: dict[str, Any]) -> str:
    value = extra.get("data_plane", DEFAULT_DATA_PLANE)
    if value not in DATA_PLANES:
        raise ValueError(
            f"kv_connector_extra_config.data_plane must be one of {list(DATA_PLANES)}, "
            f"got {value!r}"
        )
    return value


def _net_device(extra: dict[str, Any]) -> str | None:
    value = extra.get("kv_net_device")
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else []
    if not names or any(not name or name != name.strip() for name in names):
        raise ValueError(
            "kv_connector_extra_config.kv_net_device must name UCX network devices, "
            f"comma-separated without spaces (e.g. 'eth0' or 'mlx5_0:1,eth0'), got {value!r}"
        )
    return value


def _tls(extra: dict[str, Any], *, serves: bool) -> TLSFiles | None:
    given = {key: extra[key] for key in _TLS_KEYS if extra.get(key) is not None}
    if not given:
        return None
    for key, value in given.items():
        if not isinstance(value, str) or not value.strip():
            raise ValueError(
                f"kv_connector_extra_config.{key} must be a non-empty string, got {value!r}"
            )
    try:
        tls = TLSFiles(**{_TLS_KEYS[key]: value for key, value in given.items()})
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config: {_key_names(str(exc))}") from None
    if serves and tls.cert_file is None:
        raise ValueError(
            "kv_connector_extra_config.tls_cert_file and tls_key_file are required on a "
            "producer once TLS is configured: its handshake port serves TLS"
        )
    return tls


def _key_names(message: str) -> str:
    """`TLSFiles` messages in terms of kv_connector_extra_config keys."""
    for key, field in _TLS_KEYS.items():
        message = message.replace(f"TLSFiles.{field}", key)
        message = message.replace(f"when {field} is set", f"when {key} is set")
    return message
