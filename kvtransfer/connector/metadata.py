"""The small typed records a connector exchanges with the engine.

Two flows cross the scheduler/worker boundary: `KVConnectorMetadata` goes down once per step
(scheduler -> every worker), `KVConnectorHandshakeMetadata` goes up once at start-up (every
worker -> scheduler, keyed by ``(pp_rank, tp_rank)``) and then out to remote engines over the
`KVHandshake` gRPC service.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtransfer.connector.kv_groups import KVCacheGroup


class KVConnectorRole(enum.IntEnum):
    """Which half of a connector an instance is: one class, two instances, two processes."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """Per-step instructions from the scheduler-side connector to the worker-side connector.

    Built once per step by `build_connector_meta`, bound on every worker before the forward and
    cleared after it. Subclasses must be picklable (they cross process boundaries) and must not be
    mutated by workers: every worker of the step receives the same object.
    """


class KVConnectorHandshakeMetadata(BaseModel):
    """What one worker publishes so remote engines can reach its KV memory.

    A pydantic model so it crosses processes and the network as plain JSON, never pickle: a
    remote engine's payload is decoded by the *local* connector's own class, so nothing on the
    wire can choose which code runs. Subclasses add fields; they stay immutable.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, payload: bytes) -> KVConnectorHandshakeMetadata:
        """Decode a payload published by a peer; a malformed one raises `ValueError`."""
        try:
            return cls.model_validate_json(payload)
        except ValidationError as exc:
            raise ValueError(f"malformed {cls.__name__} handshake payload: {exc}") from exc


@dataclass(frozen=True)
class LayerWidth:
    """An attention layer whose per-token vectors are not the engine's ``head_dim`` x ``dtype``
    (`KVCacheLayout`): DeepSeek-V3.2's indexer k-cache (one uint8 vector of keys and scales per
    token) beside its MLA latents. ``head_dim``: each of the two halves a block is moved as."""

    name: str
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix


@dataclass(frozen=True)
class KVCacheLayout:
    """What the engine tells a connector about the KV cache when it creates it (passed as
    ``kv_cache_config``). The scheduler half gets ``pp_rank``/``tp_rank`` ``None``; each worker
    half gets its own coordinates. Layer names and per-layer tensors arrive later, in
    `register_kv_caches`.
    """

    model: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int
    num_blocks: int
    num_layers: int  # the whole target model's
    num_kv_heads: int  # the whole model's, before TP sharding
    head_dim: int
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int | None = None
    pp_rank: int | None = None
    # The axis order of the tensors `register_kv_caches` receives, outermost first (see
    # `kvtransfer.connector.kv_layout`): ours is "B2HND", vLLM's CPU backend "BH2ND". Connectors
    # index them through `canonical_kv_caches`.
    kv_order: str = "B2HND"
    # The engine's name for the cache's element format when it is not ``dtype`` itself (vLLM's
    # ``--kv-cache-dtype``, e.g. "fp8_e4m3": the tensors are uint8); "auto": ``dtype``. Part of
    # the compatibility hash: bytes of one fp8 format are not another's.
    cache_dtype: str = "auto"
    # The KV cache groups of a hybrid model (see `kvtransfer.connector.kv_groups`), in the
    # order the engine lists a request's block ids; empty: one full-attention group of every
    # layer. ``null_block_id``: the block the engine puts in a group's list for blocks it
    # skipped (before a sliding window); never moved, never lent.
    groups: tuple[KVCacheGroup, ...] = ()
    null_block_id: int | None = None
    # Attention layers whose width or element type differs from ``head_dim`` and ``dtype``
    # (each listed once); every other attention layer has the engine's.
    layer_widths: tuple[LayerWidth, ...] = ()

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    def width_of(self, layer_name: str) -> tuple[int, str]:
        """``(head_dim, dtype)`` of an attention layer: its own if listed, else the engine's."""
        for width in self.layer_widths:
            if width.name == layer_name:
                return width.head_dim, width.dtype
        return self.head_dim, self.dtype

    @property
    def rank(self) -> PpTpRank | None:
        """``(pp_rank, tp_rank)`` on a worker, ``None`` on the scheduler."""
        if self.pp_rank is None or self.tp_rank is None:
            return None
        return self.pp_rank, self.tp_rank


PpTpRank = tuple[int, int]
"""A worker's place in an engine: ``(pp_rank, tp_rank)``."""


def canonical_kv_caches(
    kv_caches: Mapping[str, Any], layout: KVCacheLayout | None
) -> dict[str, Any]:
    """``kv_caches`` as ``[num_blocks, 2, heads, block_size, head_dim]`` views of the engine's
    own tensors (no copy), whatever ``layout.kv_order`` they are stored in; `ValueError` for a
    tensor that does not fit that order."""
    from kvtransfer.connector.kv_layout import canonical_kv_view

    order = "B2HND" if layout is None else layout.kv_order
    views = {}
    for name, tensor in kv_caches.items():
        try:
            views[name] = canonical_kv_view(tensor, order)
        except ValueError as exc:
            raise ValueError(f"KV cache {name!r}: {exc}") from exc
    return views


def merge_handshake_metadata(
    per_worker: Sequence[Mapping[PpTpRank, KVConnectorHandshakeMetadata] | None],
) -> dict[PpTpRank, KVConnectorHandshakeMetadata]:
    """Merge what every worker returned into one ``{(pp_rank, tp_rank): metadata}`` dict.

    Workers without a connector (or whose connector publishes nothing) return ``None`` and are
    skipped. Two workers claiming the same rank is a wiring bug that would silently drop one
    worker's memory from the handshake, so it raises instead.
    """
    merged: dict[PpTpRank, KVConnectorHandshakeMetadata] = {}
    for worker_index, metadata in enumerate(per_worker):
        if metadata is None:
            continue
        for rank, md in metadata.items():
            check_rank_key(rank)
            if rank in merged:
                raise ValueError(
                    f"two workers published handshake metadata for (pp_rank, tp_rank)={rank}; "
                    f"the second is worker #{worker_index}"
                )
            merged[rank] = md
    return merged


def check_rank_key(rank: object) -> None:
    """Raise `ValueError` unless ``rank`` is a ``(pp_rank, tp_rank)`` pair of ints >= 0."""
    if not (
        isinstance(rank, tuple)
        and len(rank) == 2
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rank)
    ):
        raise ValueError(
            f"handshake ranks must be (pp_rank, tp_rank) pairs of non-negative ints, got {rank!r}"
        )


@runtime_checkable
class KVRequest(Protocol):
    """What the scheduler-side hooks may read from a request (the engine's `Request` has more).

    Connectors must treat it as read-only, except that `request_finished` returns new
    ``kv_transfer_params`` instead of editing the request's.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: Mapping[str, Any] | None

    @property
    def num_tokens(self) -> int: ...


class KVConnectorStats(BaseModel):
    """Counters one connector instance gathered since it was last asked.

    `aggregate` merges the stats of two workers (numbers add, lists concatenate); connectors with
    richer stats subclass and override it. `reduce` turns them into flat numbers for metrics.
    """

    model_config = ConfigDict(extra="forbid")

    data: dict[str, Any] = Field(default_factory=dict)

    def is_empty(self) -> bool:
        return not self.data

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for key, value in other.data.items():
            if key not in merged:
                merged[key] = value
            elif isinstance(value, list):
                merged[key] = [*merged[key], *value]
            else:
                merged[key] = merged[key] + value
        return type(self)(data=merged)

    def reduce(self) -> dict[str, float]:
        return {
            key: float(sum(value) if isinstance(value, list) else value)
            for key, value in self.data.items()
        }
