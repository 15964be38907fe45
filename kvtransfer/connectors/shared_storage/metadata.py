"""What the two halves of `SharedStorageConnector` exchange, and the ``kv_transfer_params``.

* `SharedStorageHandshakeMetadata`: published once by every worker (its global rank, layers,
  local KV heads per layer, dtype, block size); the scheduler half derives the engine's TP/PP
  split and checks the workers agree.
* `SharedStorageConnectorMetadata`: per step, scheduler -> every worker: which requests to save
  and which to load, plus the engine's TP/PP size so each worker knows its own rank.
* `RemotePrefill`: the consumer-side ``kv_transfer_params`` a producer returned, validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata, KVConnectorMetadata


class SharedStorageHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's identity and KV layout.

    ``global_rank`` is the worker's torch.distributed rank (0 in a single-process engine), which
    the engine defines as ``pp_rank * tp_size + tp_rank``; the scheduler half checks it against
    the ``(pp_rank, tp_rank)`` key the engine files this payload under. ``num_kv_heads[i]`` is
    the number of KV heads this worker holds of ``layer_names[i]``; with TP size ``T`` and TP
    rank ``t`` they are the global heads ``[t * n, (t + 1) * n)`` of ``n * T``.
    """

    engine_id: str
    global_rank: int
    layer_names: tuple[str, ...]
    num_kv_heads: tuple[int, ...]
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str


@dataclass(frozen=True)
class SaveSpec:
    """Save the KV of ``token_ids`` (a request's first prompt tokens) held in ``block_ids``."""

    req_id: str
    directory: str
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class LoadSpec:
    """Load positions ``[start_token, len(token_ids))`` of a request into its blocks.

    ``block_ids`` is the request's whole block table; blocks wholly before ``start_token``
    (local prefix-cache hits) are not written. ``token_ids`` are the request's first tokens, to
    be checked against the tokens the producer saved.
    """

    req_id: str
    directory: str
    remote_tp_size: int
    remote_pp_size: int
    block_ids: tuple[int, ...]
    start_token: int
    token_ids: tuple[int, ...]

    @property
    def end_token(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    """One step's work. ``tp_size``/``pp_size`` are this engine's (``None`` before the
    handshake): a worker's ``(pp_rank, tp_rank)`` is ``divmod(global_rank, tp_size)``."""

    tp_size: int | None = None
    pp_size: int | None = None
    saves: tuple[SaveSpec, ...] = ()
    loads: tuple[LoadSpec, ...] = ()


@dataclass(frozen=True)
class RemotePrefill:
    """The ``kv_transfer_params`` of a request whose prompt KV a producer saved."""

    remote_engine_id: str
    remote_request_id: str
    remote_num_tokens: int
    tp_size: int
    pp_size: int

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """``None`` unless ``do_remote_prefill`` is true; raises `ValueError` naming the first
        missing or mistyped key."""
        if not params or not _flag(params, "do_remote_prefill"):
            return None
        return cls(
            remote_engine_id=_text(params, "remote_engine_id"),
            remote_request_id=_text(params, "remote_request_id"),
            remote_num_tokens=_count(params, "remote_num_tokens", 0),
            tp_size=_count(params, "tp_size", 1),
            pp_size=_count(params, "pp_size", 1),
        )


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request asks its prompt KV to be kept for a remote decode engine."""
    return bool(params) and _flag(params, "do_remote_decode")


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"kv_transfer_params.{key} must be a bool, got {value!r}")
    return value


def _text(params: Mapping[str, Any], key: str) -> str:
    if key not in params:
        raise ValueError(f"kv_transfer_params.{key} is missing")
    value = params[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_transfer_params.{key} must be a non-empty string, got {value!r}")
    return value


def _count(params: Mapping[str, Any], key: str, minimum: int) -> int:
    if key not in params:
        raise ValueError(f"kv_transfer_params.{key} is missing")
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"kv_transfer_params.{key} must be an int >= {minimum}, got {value!r}")
    return value
