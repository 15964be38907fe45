"""What the halves of `UcxConnector` and the two engines exchange.

* `UcxHandshakeMetadata`: published once by every worker and served over `KVHandshake`: where
  its transfer agent listens and which layers, KV heads and blocks it holds.
* `UcxConnectorMetadata`: per step, scheduler -> every worker: requests to load (`LoadSpec`),
  newly held requests whose blocks consumers may read with their secret (`Grant`), and held
  requests whose blocks the producer may now free (`Release`; their grants end).
* `RemotePrefill`: the ``kv_transfer_params`` a producer returned, validated on the consumer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtransfer.connector.kv_groups import FULL_ATTENTION, BlockIds
from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata, KVConnectorMetadata
from kvtransfer.connector.state_parts import StatePart, part_layer_name
from kvtransfer.transport import KVLayout, LeaseAccess

_NonNegative = Field(ge=0)
_Positive = Field(gt=0)


class UcxLayer(BaseModel):
    """One KV layer a worker holds. ``index`` is the layer's index in its own model (target or
    drafter); ``num_kv_heads`` is how many KV heads of it this worker holds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    index: int = _NonNegative
    is_draft: bool
    num_kv_heads: int = _Positive
    # The layer's KV cache group, as `kv_groups.KVCacheGroup.label` (kind and window): a
    # consumer pulls a layer only from a producer layer of the same kind.
    kv_group: str = FULL_ATTENTION
    # A recurrent-state layer: each block is one page of 2 x ``state_width`` bytes (uint8) per
    # head it holds (``num_kv_heads``), not heads of tokens; None for attention layers.
    state_width: int | None = Field(default=None, gt=0)
    # Its page is laid out per head: a consumer of another TP size reads the heads it holds.
    # False: one opaque page (``num_kv_heads`` 1), moved whole between equal TP sizes.
    state_split: bool = False
    # Its opaque pages hold sub-projections split by heads across TP ranks (vLLM's Mamba2 and
    # Gated DeltaNet pages): each is registered as its own transport layer and a consumer of
    # another TP size reads each part's heads it holds. Empty: the page moves whole.
    state_parts: tuple[StatePart, ...] = ()
    # Its opaque page is the same on every TP rank (DeepSeek-V4's whole pages): a consumer of
    # any TP size reads it from one producer rank.
    replicated: bool = False
    # An attention layer whose vectors are not the engine's ``head_dim`` x ``dtype`` (the
    # handshake's): DeepSeek-V3.2's indexer k-cache beside its MLA latents. None: the engine's.
    head_dim: int | None = Field(default=None, gt=0)
    dtype: str | None = Field(default=None, min_length=1)


class UcxHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's transfer agent and KV slice.

    ``kv_heads`` is the half-open range of the target model's global KV heads this worker
    holds (of ``total_kv_heads``); ``draft_kv_heads``/``draft_total_kv_heads`` the same for the
    drafter's layers, set only on workers that hold them (the last PP stage).
    """

    engine_id: str = Field(min_length=1)
    pp_rank: int = _NonNegative
    tp_rank: int = _NonNegative
    pp_size: int = _Positive
    tp_size: int = _Positive
    agent_address: str = Field(min_length=1)  # base64 of the agent's address bytes
    layers: tuple[UcxLayer, ...] = Field(min_length=1)
    kv_heads: tuple[int, int]
    total_kv_heads: int = _Positive
    draft_kv_heads: tuple[int, int] | None = None
    draft_total_kv_heads: int | None = None
    block_size: int = _Positive  # the engine's (tokens per block its scheduler counts)
    head_dim: int = _Positive
    dtype: str = Field(min_length=1)
    num_blocks: int = _Positive
    # The caches registered hold each engine block as this many kernel blocks of
    # block_size / kernel_blocks tokens (vLLM's kernel block split); 1: no split.
    kernel_blocks: int = Field(default=1, gt=0)
    # How this worker's KV may be read: "rma" offers one-sided reads (keys per lease).
    data_plane: Literal["rma", "tagged", "push"] = "tagged"

    @model_validator(mode="after")
    def _consistent(self) -> UcxHandshakeMetadata:
        if self.pp_rank >= self.pp_size or self.tp_rank >= self.tp_size:
            raise ValueError(
                f"rank (pp {self.pp_rank}, tp {self.tp_rank}) outside TP {self.tp_size} x PP "
                f"{self.pp_size}"
            )
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names repeat")
        if (self.draft_kv_heads is None) != (self.draft_total_kv_heads is None):
            raise ValueError("draft_kv_heads and draft_total_kv_heads go together")
        if self.block_size % self.kernel_blocks:
            raise ValueError(
                f"block_size {self.block_size} is not {self.kernel_blocks} kernel blocks"
            )
        return self

    def agent_address_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.agent_address, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(
                f"worker (pp {self.pp_rank}, tp {self.tp_rank}) of engine {self.engine_id!r} "
                f"published an agent address that is not base64: {exc}"
            ) from exc

    def layouts(self) -> dict[str, KVLayout]:
        """Per-layer layouts of the registered (kernel) blocks, so pulls are checked locally
        before any traffic."""
        k = self.kernel_blocks
        layouts = {}
        for layer in self.layers:
            if layer.state_width is None:
                layouts[layer.name] = KVLayout(
                    self.num_blocks * k,
                    layer.num_kv_heads,
                    self.block_size // k,
                    *self.width_of(layer),
                )
            elif not layer.state_parts:
                layouts[layer.name] = KVLayout(
                    self.num_blocks, layer.num_kv_heads, 1, layer.state_width, "uint8"
                )
            for part in layer.state_parts:
                layouts[part_layer_name(layer.name, part.name)] = KVLayout(
                    self.num_blocks, part.heads, part.rows, part.head_bytes // 2, "uint8"
                )
        return layouts

    def width_of(self, layer: UcxLayer) -> tuple[int, str]:
        """``(head_dim, dtype)`` of an attention layer this worker holds."""
        return layer.head_dim or self.head_dim, layer.dtype or self.dtype

    def target_layers(self) -> list[UcxLayer]:
        return sorted((layer for layer in self.layers if not layer.is_draft), key=_index)

    def draft_layers(self) -> list[UcxLayer]:
        return sorted((layer for layer in self.layers if layer.is_draft), key=_index)


def _index(layer: UcxLayer) -> int:
    return layer.index


@dataclass(frozen=True)
class RemotePrefill:
    """The ``kv_transfer_params`` of a request whose prompt KV a producer holds for us."""

    engine_id: str
    request_id: str
    # One tuple per KV cache group (the params' flat list is the one-group case): each group's
    # blocks the producer holds, ending at the last computed block (a sliding-window group's
    # list is that tail).
    block_ids: BlockIds
    host: str
    port: int
    tp_size: int
    pp_size: int
    num_tokens: int
    # The lease's capability: every pull, keep-alive and release presents it.
    secret: str = field(repr=False)
    # sha256 of the prompt tokens the producer computed (`prompt_digest`).
    prompt_digest: str
    # The producer's handshake generation; a restarted producer has lost these blocks.
    generation: int | None = None
    # Announced while the producer computes it: pull it layer by layer, as each is ready.
    streaming: bool = False

    @property
    def lease_blocks(self) -> tuple[int, ...]:
        """Every group's blocks, group after group: the lease's block list."""
        return tuple(b for group in self.block_ids for b in group)

    @property
    def address(self) -> str:
        if ":" in self.host and not self.host.startswith("["):
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """``None`` unless ``do_remote_prefill`` is true; raises `ValueError` naming the first
        missing or mistyped key."""
        if not params or not _flag(params, "do_remote_prefill"):
            return None
        generation = params.get("remote_generation")
        if generation is not None:
            generation = _count(params, "remote_generation", 0)
        return cls(
            engine_id=_text(params, "remote_engine_id"),
            request_id=_text(params, "remote_request_id"),
            block_ids=_block_id_groups(params, "remote_block_ids"),
            host=_text(params, "remote_host"),
            port=_port(params, "remote_port"),
            tp_size=_count(params, "tp_size", 1),
            pp_size=_count(params, "pp_size", 1),
            num_tokens=_count(params, "remote_num_tokens", 0),
            secret=_text(params, "remote_kv_secret"),
            prompt_digest=_digest(params, "remote_prompt_digest"),
            generation=generation,
            streaming=_flag(params, "remote_streaming"),
        )


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request asks its prompt KV to be kept for a remote decode engine."""
    return bool(params) and _flag(params, "do_remote_decode")


def wants_kv_stream(params: Mapping[str, Any] | None) -> bool:
    """Whether it also asks for its params early and its KV served layer by layer as computed
    (``kv_stream``, with ``do_remote_decode``)."""
    return wants_remote_decode(params) and _flag(params, "kv_stream")


@dataclass(frozen=True)
class BlockRun:
    """Copy the producer's ``remote_block_ids`` into this engine's ``local_block_ids`` (index
    by index) for the layers of KV cache group ``group``. ``lease_offset``: the position of
    the first remote block in the lease's block list (every group's blocks, in order)."""

    group: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    lease_offset: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """Load a producer's KV into this engine's blocks: one `BlockRun` per KV cache group with
    something to move (blocks already in the local prefix cache are not listed)."""

    req_id: str
    remote: RemotePrefill
    runs: tuple[BlockRun, ...]
    # Kernel blocks per engine block in the caches both workers registered (vLLM splits a
    # block into kernel blocks for some backends): set by the consumer worker, which reads and
    # writes kernel blocks; the scheduler plans in engine blocks.
    kernel_blocks: int = 1
    # Why the params' block lists do not fit this engine's groups, found by the scheduler:
    # the load fails with it after the producer's handshake, whose compatibility check names
    # a producer of another model first. ``runs`` then list the blocks the load would have
    # written (no remote blocks), which the failure reports invalid.
    refused: str = ""

    @classmethod
    def one_group(
        cls,
        req_id: str,
        remote: RemotePrefill,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        remote_offset: int = 0,
    ) -> LoadSpec:
        """The load of a model with one KV cache group (full attention everywhere)."""
        run = BlockRun(0, tuple(remote_block_ids), tuple(local_block_ids), remote_offset)
        return cls(req_id, remote, (run,))

    @property
    def local_block_ids(self) -> tuple[int, ...]:
        """Every local block the load writes (what a failed load leaves invalid)."""
        return tuple(b for run in self.runs for b in run.local_block_ids)

    def kernel_ids(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        return kernel_block_ids(block_ids, self.kernel_blocks)

    def lease_at(self, run: BlockRun) -> LeaseAccess:
        """What ``run``'s pulls present (the prompt digest was checked against this engine's
        own prompt before the load was planned), in the registered (kernel) blocks the
        producer granted."""
        remote = self.remote
        return LeaseAccess(
            remote.request_id,
            remote.secret,
            remote.prompt_digest,
            run.lease_offset * self.kernel_blocks,
            kernel_block_ids(remote.lease_blocks, self.kernel_blocks),
        )


def kernel_block_ids(block_ids: Sequence[int], kernel_blocks: int) -> tuple[int, ...]:
    """Engine block ``b`` as the ``kernel_blocks`` registered blocks that hold it, in order."""
    if kernel_blocks == 1:
        return tuple(block_ids)
    return tuple(b * kernel_blocks + k for b in block_ids for k in range(kernel_blocks))


@dataclass(frozen=True)
class Grant:
    """A request the producer now holds: its workers serve ``block_ids`` (in this order) to
    pulls presenting the secret whose sha256 is ``secret_digest`` and ``prompt_digest``."""

    req_id: str
    secret_digest: bytes = field(repr=False)
    block_ids: tuple[int, ...]
    prompt_digest: str = ""
    # Granted in the step that computes the prompt's last part: each layer is served once this
    # step's `save_kv_layer` ran for it (layer-wise streaming).
    streaming: bool = False


@dataclass(frozen=True)
class Release:
    """A producer request whose blocks the workers may free: its consumer is done with them
    (``num_blocks`` it read) or nobody pulled them in time (``expired``)."""

    req_id: str
    num_blocks: int = 0
    expired: bool = False


@dataclass(frozen=True)
class UcxConnectorMetadata(KVConnectorMetadata):
    loads: tuple[LoadSpec, ...] = ()
    grants: tuple[Grant, ...] = ()
    releases: tuple[Release, ...] = ()


def prompt_digest(token_ids: Sequence[int]) -> str:
    """sha256 (hex) of token ids as little-endian int64: what a consumer compares its own
    prompt with before it loads a producer's KV."""
    packed = array("q", token_ids)
    if packed.itemsize != 8 or array("h", [1]).tobytes() != b"\x01\x00":
        raise RuntimeError("prompt_digest assumes a little-endian host with 8-byte longs")
    return hashlib.sha256(packed.tobytes()).hexdigest()


def _digest(params: Mapping[str, Any], key: str) -> str:
    value = _text(params, key)
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"kv_transfer_params.{key} must be 64 lowercase hex digits (sha256)")
    return value


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"kv_transfer_params.{key} must be a bool, got {value!r}")
    return value


def _present(params: Mapping[str, Any], key: str) -> Any:
    if key not in params:
        raise ValueError(f"kv_transfer_params.{key} is missing")
    return params[key]


def _text(params: Mapping[str, Any], key: str) -> str:
    value = _present(params, key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"kv_transfer_params.{key} must be a non-empty string, got {value!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(params: Mapping[str, Any], key: str, minimum: int) -> int:
    value = _present(params, key)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"kv_transfer_params.{key} must be an int >= {minimum}, got {value!r}")
    return value


def _port(params: Mapping[str, Any], key: str) -> int:
    value = _present(params, key)
    if not _is_int(value) or not 0 < value < 65536:
        raise ValueError(f"kv_transfer_params.{key} must be a port in [1, 65535], got {value!r}")
    return value


def _block_id_groups(params: Mapping[str, Any], key: str) -> BlockIds:
    """A flat list of block ids (one KV cache group) or a list of such lists (one per group,
    vLLM's hybrid shape)."""
    value = _present(params, key)
    if _is_list(value) and value and all(_is_list(group) for group in value):
        groups = value
    elif _is_list(value) and not any(_is_list(b) for b in value):
        groups = [value]
    else:
        groups = None
    if groups is None or not all(_is_int(b) and b >= 0 for group in groups for b in group):
        raise ValueError(
            f"kv_transfer_params.{key} must be a list of block ids (ints >= 0), or one such "
            f"list per KV cache group, got {value!r}"
        )
    return tuple(tuple(group) for group in groups)


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)
