"""Where a layer's KV lives in memory, and the contiguous runs a one-sided read copies.

A `LayerMemory` describes one registered layer as a ``B2HND``-indexed strided view: the address
of element ``[0, 0, 0, 0, 0]``, the byte stride of each axis and the memory region (one per
tensor storage) that holds it. It is addressed by storage and strides, never by assuming a
contiguous tensor, so vLLM-style views into one shared buffer (block-outermost, kernel-split
K/V) describe themselves like any other layer.

`layer_runs` turns "these heads of these blocks of this layer" into ``(local address, remote
address, bytes)`` runs: the innermost axes that are contiguous on *both* sides (head dim, then
tokens, then the head slice, then K/V) form one atom, and consecutive atoms that continue each
other on both sides merge, across blocks and across layers (`merge_runs`). Everything is numpy:
no Python loop per block or per head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.transport.spec import dtype_name


@dataclass(frozen=True)
class LayerMemory:
    """One layer's KV in one process: ``[blocks, 2, heads, block_size, head_dim]`` of
    ``dtype`` at ``address`` with byte ``strides``, inside memory region ``region``."""

    name: str
    region: int
    address: int
    shape: tuple[int, int, int, int, int]
    strides: tuple[int, int, int, int, int]
    dtype: str
    # ucs_memory_type_t of the memory (0 host, 1 CUDA); not published (the region says it).
    memory: int = 0

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, region: int = 0) -> LayerMemory:
        size = tensor.element_size()
        return cls(
            name,
            region,
            tensor.data_ptr(),
            tuple(tensor.shape),  # type: ignore[arg-type]
            tuple(s * size for s in tensor.stride()),  # type: ignore[arg-type]
            dtype_name(tensor.dtype),
            1 if tensor.is_cuda else 0,
        )

    @property
    def element_size(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "region": self.region,
            "address": self.address,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LayerMemory:
        try:
            shape = tuple(int(v) for v in data["shape"])  # type: ignore[union-attr]
            strides = tuple(int(v) for v in data["strides"])  # type: ignore[union-attr]
            layer = cls(
                name=str(data["name"]),
                region=int(data["region"]),  # type: ignore[call-overload]
                address=int(data["address"]),  # type: ignore[call-overload]
                shape=shape,  # type: ignore[arg-type]
                strides=strides,  # type: ignore[arg-type]
                dtype=str(data["dtype"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad layer memory description {dict(data)!r}: {exc}") from exc
        if len(shape) != 5 or len(strides) != 5 or shape[1] != 2 or min(shape) <= 0:
            raise ValueError(f"layer {layer.name!r}: shape {shape} is not [B, 2, H, N, D]")
        if (
            min(strides) < 0
            or layer.address <= 0
            or not isinstance(getattr(torch, layer.dtype, None), torch.dtype)
        ):
            raise ValueError(f"layer {layer.name!r}: bad address, strides or dtype")
        return layer

    def extent(self) -> tuple[int, int]:
        """First and one-past-last byte address any element of the layer occupies."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.address, self.address + last + self.element_size


@dataclass(frozen=True)
class Runs:
    """Contiguous copies: ``lengths[i]`` bytes from remote ``remote[i]`` (remote key
    ``keys[i]``) to local ``local[i]``."""

    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    keys: np.ndarray

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class RunGrid:
    """What `layer_runs` computes without the block ids: the atom and where each atom of a
    block starts relative to the block (head slice included), on both sides. A reader keeps
    one per layer geometry, so a pull costs only the per-block arithmetic."""

    atom: int
    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    local_block_stride: int
    remote_block_stride: int

    @classmethod
    def of(
        cls,
        local: LayerMemory,
        remote: LayerMemory,
        local_heads: range,
        remote_heads: range,
    ) -> RunGrid:
        """`ValueError` if the two layers cannot exchange these heads."""
        if local.dtype != remote.dtype or local.shape[3:] != remote.shape[3:]:
            raise ValueError(
                f"layer {local.name!r}: local {local.dtype} {local.shape[3:]} (block size, "
                f"head dim) does not match remote {remote.dtype} {remote.shape[3:]}"
            )
        if len(local_heads) != len(remote_heads):
            raise ValueError(f"head slices {local_heads} and {remote_heads} differ in size")
        size = local.element_size
        if local.strides[4] != size or remote.strides[4] != size:
            raise ValueError(f"layer {local.name!r}: head_dim elements are not contiguous")
        block_size, head_dim = local.shape[3], local.shape[4]
        # Innermost first (by the local layout): tokens, heads of the slice, K/V in B2HND; the
        # atom grows while both sides continue it.
        counts = {3: block_size, 2: len(local_heads), 1: 2}
        axes = sorted(counts, key=lambda axis: local.strides[axis])
        atom = head_dim * size
        absorbed = 0
        for axis in axes:
            if counts[axis] == 1:
                absorbed += 1
                continue
            if local.strides[axis] != atom or remote.strides[axis] != atom:
                break
            atom *= counts[axis]
            absorbed += 1
        outer = [(axis, counts[axis]) for axis in axes[absorbed:]]
        local_grid = np.full(1, local_heads.start * local.strides[2], dtype=np.int64)
        remote_grid = np.full(1, remote_heads.start * remote.strides[2], dtype=np.int64)
        # Outermost first, so runs come out in address order for a dense layer.
        for axis, count in reversed(outer):
            steps = np.arange(count, dtype=np.int64)
            local_grid = (local_grid[:, None] + steps * local.strides[axis]).reshape(-1)
            remote_grid = (remote_grid[:, None] + steps * remote.strides[axis]).reshape(-1)
        return cls(atom, local_grid, remote_grid, local.strides[0], remote.strides[0])

    def runs(
        self,
        local_ids: np.ndarray,
        remote_ids: np.ndarray,
        local_base: int = 0,
        remote_base: int = 0,
        key: int = 0,
    ) -> Runs:
        """The merged runs of these blocks (paired index by index) of layers at these bases."""
        local_start = local_ids * self.local_block_stride + local_base
        remote_start = remote_ids * self.remote_block_stride + remote_base
        if len(self.local_offsets) == 1:
            local_all = local_start + int(self.local_offsets[0])
            remote_all = remote_start + int(self.remote_offsets[0])
        else:
            local_all = (local_start[:, None] + self.local_offsets).reshape(-1)
            remote_all = (remote_start[:, None] + self.remote_offsets).reshape(-1)
        lengths = np.full(len(local_all), self.atom, dtype=np.int64)
        keys = np.full(len(local_all), key, dtype=np.int64)
        return merge_runs(Runs(local_all, remote_all, lengths, keys))


def layer_runs(
    local: LayerMemory,
    remote: LayerMemory,
    local_ids: Sequence[int] | np.ndarray,
    remote_ids: Sequence[int] | np.ndarray,
    local_heads: range,
    remote_heads: range,
) -> Runs:
    """The runs copying ``remote_heads`` of ``remote_ids`` into ``local_heads`` of
    ``local_ids`` (paired index by index), merged; ``keys`` holds the remote region."""
    grid = RunGrid.of(local, remote, local_heads, remote_heads)
    return grid.runs(
        np.asarray(local_ids, dtype=np.int64),
        np.asarray(remote_ids, dtype=np.int64),
        local.address,
        remote.address,
        remote.region,
    )


def concat_runs(parts: Sequence[Runs]) -> Runs:
    """All ``parts`` in order, merged where one part's last run continues into the next."""
    if len(parts) == 1:
        return parts[0]
    return merge_runs(
        Runs(
            np.concatenate([p.local for p in parts]),
            np.concatenate([p.remote for p in parts]),
            np.concatenate([p.lengths for p in parts]),
            np.concatenate([p.keys for p in parts]),
        )
    )


def merge_runs(runs: Runs) -> Runs:
    """Merge each run into its predecessor when both sides continue it under the same key."""
    if len(runs) <= 1:
        return runs
    local, remote, lengths, keys = runs.local, runs.remote, runs.lengths, runs.keys
    continues = (
        (local[1:] == local[:-1] + lengths[:-1])
        & (remote[1:] == remote[:-1] + lengths[:-1])
        & (keys[1:] == keys[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    if len(starts) == len(lengths):
        return runs
    return Runs(local[starts], remote[starts], np.add.reduceat(lengths, starts), keys[starts])
