"""What a pull reads and writes: `PullSpec`, the `KVLayout` of one layer, and their checks.

Everything here indexes one attention layer's cache as ``[num_blocks, 2, num_kv_heads,
block_size, head_dim]`` (axes ``B2HND``: block, K/V, head, token, head dim). That is how our
engine allocates it (heads outside tokens, so a head slice of a block is one run per K/V plane).
Other engines order the axes differently in memory: vLLM's CPU backend allocates
``[blocks, heads, block_size, 2 * head_dim]`` and reads it as ``[blocks, heads, 2 * block_size,
head_dim]``, K's tokens then V's (``BH2ND``); its GPU backends put K and V first (``2BNHD``,
``2BHND``). Such a cache is registered as a *view* in ``B2HND`` order of its own
memory (`canonical_kv_view`); its physical order (`kv_axis_order`) is part of its `KVLayout`.
Payloads on the wire are always ``B2HND``, so the two ends of a pull may differ in physical
order: gather and scatter convert, head slices included.

A pull copies, for every listed layer, the blocks ``remote_block_ids[i]`` of the remote tensor,
heads ``remote_heads``, into blocks ``local_block_ids[i]``, heads ``local_heads``, of the local
tensor. The same head range applies to K and V.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtransfer.connector.kv_layout import (
    KV_AXES,
    KV_CACHE_NDIM,
    axis_order,
    kv_axis_order,
)
from kvtransfer.connector.topology import HeadSource
from kvtransfer.transport.access import LeaseAccess


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one layer's KV cache on one rank, as published to peers."""

    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str
    # The axes of ``KV_AXES`` from outermost to innermost in memory (informational: payloads
    # are converted, so peers need not agree on it).
    order: str = KV_AXES

    @classmethod
    def of(cls, tensor: torch.Tensor) -> KVLayout:
        """The layout of a registered (``B2HND``-indexed) cache."""
        num_blocks, _, heads, block_size, head_dim = tensor.shape
        return cls(
            num_blocks, heads, block_size, head_dim, dtype_name(tensor.dtype), kv_axis_order(tensor)
        )

    @property
    def element_size(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def head_elems(self) -> int:
        """Elements of one head of one block in one K/V plane."""
        return self.block_size * self.head_dim

    def as_dict(self) -> dict[str, int | str]:
        return {
            "num_blocks": self.num_blocks,
            "num_kv_heads": self.num_kv_heads,
            "block_size": self.block_size,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "order": self.order,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> KVLayout:
        try:
            return cls(
                num_blocks=int(data["num_blocks"]),  # type: ignore[call-overload]
                num_kv_heads=int(data["num_kv_heads"]),  # type: ignore[call-overload]
                block_size=int(data["block_size"]),  # type: ignore[call-overload]
                head_dim=int(data["head_dim"]),  # type: ignore[call-overload]
                dtype=str(data["dtype"]),
                order=axis_order("order", data.get("order", KV_AXES)),
            )
        except KeyError as exc:
            raise ValueError(f"KV layout lacks field {exc.args[0]!r}: {dict(data)!r}") from exc


def _non_overlapping(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` share memory: with its axes ordered by stride,
    each axis steps over everything the axes inside it span (gaps allowed, as in vLLM's
    block-outermost views where other layers sit between a layer's blocks)."""
    axes = sorted(
        (axis for axis in range(tensor.dim()) if tensor.shape[axis] > 1),
        key=lambda axis: tensor.stride(axis),
    )
    span = 1
    for axis in axes:
        if tensor.stride(axis) < span:
            return False
        span = tensor.stride(axis) * (tensor.shape[axis] - 1) + span
    return True


def check_kv_cache(name: str, tensor: object) -> torch.Tensor:
    """Refuse anything that is not a ``[blocks, 2, heads, block, head_dim]`` view whose
    elements never share memory (any strides: contiguous in some axis order, see
    `canonical_kv_view`, or strided with gaps like vLLM's block-outermost layouts).

    Tagged pulls copy ``B2HND``-contiguous caches as whole rows, others element-wise through
    their strides; one-sided reads use each cache's contiguous runs (`rma_layout`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"KV cache layer name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"KV cache {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != KV_CACHE_NDIM or tensor.shape[1] != 2:
        raise ValueError(
            f"KV cache {name!r} has shape {tuple(tensor.shape)}; expected "
            "[num_blocks, 2, num_kv_heads, block_size, head_dim]"
        )
    if not _non_overlapping(tensor):
        raise ValueError(
            f"KV cache {name!r} has elements that share memory (shape {tuple(tensor.shape)}, "
            f"strides {tuple(tensor.stride())})"
        )
    if tensor.numel() == 0:
        raise ValueError(f"KV cache {name!r} is empty (shape {tuple(tensor.shape)})")
    return tensor


def _head_range(name: str, value: object) -> range | None:
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2:
        value = range(*value)
    if not isinstance(value, range):
        raise ValueError(f"{name} must be a range or a (start, stop) tuple, got {value!r}")
    if value.step != 1 or value.start < 0 or len(value) == 0:
        raise ValueError(
            f"{name} must be a non-empty range with step 1 and start >= 0, got {value}"
        )
    return value


def _block_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {ids.dtype} {ids.shape}")
        values = tuple(ids.tolist())
    elif isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        values = tuple(ids)
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must hold ints, got {value!r}")
    else:
        raise ValueError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    if values and min(values) < 0:
        raise ValueError(f"{name} holds a negative block id ({min(values)})")
    if values and max(values) >= 1 << 63:
        raise ValueError(f"{name} holds a block id beyond int64 ({max(values)})")
    return values


@dataclass(frozen=True)
class PullSpec:
    """One pull from one peer. Block id lists pair up index by index; heads default to all.

    ``remote_heads`` indexes the remote tensor's head axis (the remote rank's local heads),
    ``local_heads`` the local tensor's; both must hold the same number of heads. ``lease`` is
    what a server that serves leased KV only requires (see `access`).
    """

    request_id: str
    layer_names: tuple[str, ...]
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    remote_heads: range | None = None
    local_heads: range | None = None
    lease: LeaseAccess | None = None

    def __post_init__(self) -> None:
        if self.lease is not None and not isinstance(self.lease, LeaseAccess):
            raise ValueError(f"lease must be a LeaseAccess, got {type(self.lease).__name__}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        names = self.layer_names
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ValueError(f"layer_names must be a sequence of str, got {names!r}")
        names = tuple(names)
        if not names:
            raise ValueError("layer_names is empty; a pull reads at least one layer")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"layer names must be non-empty str, got {name!r}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"layer_names lists {duplicates} more than once")
        remote = _block_ids("remote_block_ids", self.remote_block_ids)
        local = _block_ids("local_block_ids", self.local_block_ids)
        if len(remote) != len(local):
            raise ValueError(
                f"remote_block_ids ({len(remote)}) and local_block_ids ({len(local)}) "
                "must have the same length"
            )
        if len(set(local)) != len(local):
            raise ValueError("local_block_ids holds a block id twice; each block is written once")
        remote_heads = _head_range("remote_heads", self.remote_heads)
        local_heads = _head_range("local_heads", self.local_heads)
        if (
            remote_heads is not None
            and local_heads is not None
            and len(remote_heads) != len(local_heads)
        ):
            raise ValueError(
                f"remote_heads {remote_heads} and local_heads {local_heads} select different "
                "numbers of heads"
            )
        # Frozen: normalise through object.__setattr__ so callers may pass lists or tensors.
        object.__setattr__(self, "layer_names", names)
        object.__setattr__(self, "remote_block_ids", remote)
        object.__setattr__(self, "local_block_ids", local)
        object.__setattr__(self, "remote_heads", remote_heads)
        object.__setattr__(self, "local_heads", local_heads)

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids)

    @classmethod
    def for_head_source(
        cls,
        request_id: str,
        layer_names: Sequence[str],
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        source: HeadSource,
    ) -> PullSpec:
        """The pull that reads one `TransferTopology.head_sources` entry."""
        return cls(
            request_id=request_id,
            layer_names=tuple(layer_names),
            remote_block_ids=tuple(remote_block_ids),
            local_block_ids=tuple(local_block_ids),
            remote_heads=range(source.remote_offset, source.remote_offset + source.num_heads),
            local_heads=range(source.local_offset, source.local_offset + source.num_heads),
        )


@dataclass(frozen=True)
class LayerPlan:
    """A validated layer of a pull: the local tensor and its head slice."""

    name: str
    layout: KVLayout
    local_heads: range


def plan_pull(
    spec: PullSpec,
    local: Mapping[str, torch.Tensor],
    remote: Mapping[str, KVLayout] | None = None,
    local_layouts: Mapping[str, KVLayout] | None = None,
) -> list[LayerPlan]:
    """Check ``spec`` against the local caches (and the peer's layouts if known).

    ``local_layouts``: the local caches' layouts if already computed. Raises `ValueError`
    naming the first mismatch; returns one plan per layer.
    """
    missing = [name for name in spec.layer_names if name not in local]
    if missing:
        raise ValueError(
            f"pull {spec.request_id!r}: layers {missing} are not registered locally "
            f"(registered: {sorted(local)})"
        )
    plans = []
    # Once, not per layer: a pull may name thousands of blocks.
    highest = max(spec.local_block_ids) if spec.local_block_ids else -1
    for name in spec.layer_names:
        layout = KVLayout.of(local[name]) if local_layouts is None else local_layouts[name]
        heads = spec.local_heads or range(layout.num_kv_heads)
        if heads.stop > layout.num_kv_heads:
            raise ValueError(
                f"pull {spec.request_id!r}: local_heads {heads} out of bounds for layer {name!r} "
                f"with {layout.num_kv_heads} heads"
            )
        if highest >= layout.num_blocks:
            raise ValueError(
                f"pull {spec.request_id!r}: local block id {highest} out of "
                f"range for layer {name!r} with {layout.num_blocks} blocks"
            )
        if spec.remote_heads is not None and len(spec.remote_heads) != len(heads):
            raise ValueError(
                f"pull {spec.request_id!r}: remote_heads {spec.remote_heads} selects "
                f"{len(spec.remote_heads)} heads but layer {name!r} writes {len(heads)}"
            )
        if remote is not None:
            _check_remote(spec, name, layout, heads, remote)
        plans.append(LayerPlan(name, layout, heads))
    return plans


def _check_remote(
    spec: PullSpec, name: str, local: KVLayout, heads: range, remote: Mapping[str, KVLayout]
) -> None:
    if name not in remote:
        raise ValueError(f"pull {spec.request_id!r}: peer has no layer {name!r}")
    peer = remote[name]
    for field in ("dtype", "block_size", "head_dim"):
        mine, theirs = getattr(local, field), getattr(peer, field)
        if mine != theirs:
            raise ValueError(
                f"pull {spec.request_id!r}: layer {name!r} {field} mismatch: local {mine}, "
                f"remote {theirs}"
            )
    remote_heads = spec.remote_heads or range(peer.num_kv_heads)
    if remote_heads.stop > peer.num_kv_heads or len(remote_heads) != len(heads):
        raise ValueError(
            f"pull {spec.request_id!r}: remote heads {remote_heads} of layer {name!r} do not fit "
            f"the peer's {peer.num_kv_heads} heads or the {len(heads)} local heads"
        )
    if spec.remote_block_ids and max(spec.remote_block_ids) >= peer.num_blocks:
        raise ValueError(
            f"pull {spec.request_id!r}: remote block id {max(spec.remote_block_ids)} out of "
            f"range for layer {name!r} with {peer.num_blocks} blocks on the peer"
        )
