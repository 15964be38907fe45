"""`UcxConfig`: the `UcxConnector`'s settings, read from a `KVTransferConfig` and checked.

``kv_ip``/``kv_port`` (vLLM's top-level keys) say where a producer serves its handshake; the
connector's own keys live in ``kv_connector_extra_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtransfer.config import KVTransferConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_LEASE_S = 30.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONCURRENT_LOADS = 4

_SECONDS_KEYS = ("kv_lease_s", "transfer_timeout_s", "handshake_timeout_s")
_EXTRA_KEYS = (*_SECONDS_KEYS, "max_concurrent_loads")


@dataclass(frozen=True)
class UcxConfig:
    """``lease_s``: how long a producer keeps a finished request's blocks for a consumer that
    has not pulled them (consumers extend it while they wait). ``transfer_timeout_s`` bounds one
    request's pulls, ``handshake_timeout_s`` one handshake attempt (two are made) and one UCX
    connect."""

    host: str = DEFAULT_HOST
    port: int = 0
    lease_s: float = DEFAULT_LEASE_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    max_concurrent_loads: int = DEFAULT_MAX_CONCURRENT_LOADS

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
        )


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


def _count(extra: dict[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_connector_extra_config.{key} must be an int >= 1, got {value!r}")
    return value
