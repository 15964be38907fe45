"""Gather KV blocks into one message buffer and scatter it back, plus a reusable buffer pool.

Both directions are one torch index op per layer, never a Python loop per block. The head slice
``[h0, h1)`` of a block is ``2 * (h1 - h0)`` runs of ``block_size * head_dim`` elements (K and V
planes), so the cache is viewed as rows of ``g`` heads, where ``g`` is the largest head count
that tiles both the slice and the head axis; each requested (block, plane, head group) is one
row. Row-wise `index_select` / `index_copy_` on a contiguous 2-D view copy whole rows with
memcpy, which is several times faster than indexing a strided head-sliced view.

The payload format is ``[blocks, 2, heads, block_size, head_dim]`` per layer whatever ``g`` each
side picks, so server and client choose their row size independently. A cache stored in another
axis order (a non-contiguous ``B2HND`` view, see `spec.canonical_kv_view`) has no such rows: it
is gathered and scattered through its strided view, one index op per layer all the same, which
converts between its order and the payload's (slower: element-wise, not whole runs).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

# Small buffers are cheap to allocate; pooling starts at this size class.
_MIN_POOLED = 64 << 10


@dataclass(frozen=True)
class RowView:
    """How to index one layer's cache as rows: the row width and the row indices to copy.

    ``row_elems`` 0 means a strided cache: ``rows`` are block ids and ``heads`` the slice."""

    row_elems: int
    rows: torch.Tensor
    heads: range | None = None


def row_view(
    block_ids: torch.Tensor, num_heads: int, heads: range, head_elems: int, contiguous: bool = True
) -> RowView:
    """Rows of ``cache.view(-1, row_elems)`` holding ``heads`` of ``block_ids``, payload order.

    ``head_elems`` is ``block_size * head_dim``; ``contiguous`` whether the cache is
    ``B2HND``-contiguous (else the view indexes blocks of the strided cache).
    """
    if not contiguous:
        return RowView(0, block_ids, heads)
    if heads.start == 0 and len(heads) == num_heads:
        # Whole blocks: one row per block.
        return RowView(2 * num_heads * head_elems, block_ids)
    group = math.gcd(heads.start, len(heads), num_heads)
    groups_per_plane = num_heads // group
    planes = torch.arange(2, device=block_ids.device)
    first = (block_ids[:, None] * 2 + planes) * groups_per_plane + heads.start // group
    offsets = torch.arange(len(heads) // group, device=block_ids.device)
    return RowView(group * head_elems, (first[:, :, None] + offsets).reshape(-1))


def payload_bytes(num_blocks: int, num_heads: int, head_elems: int, element_size: int) -> int:
    return num_blocks * 2 * num_heads * head_elems * element_size


def _strided(segment: torch.Tensor, cache: torch.Tensor, view: RowView) -> tuple[Any, Any]:
    _, _, num_heads, block_size, head_dim = cache.shape
    heads = view.heads if view.heads is not None else range(num_heads)
    payload = segment.view(cache.dtype).view(len(view.rows), 2, len(heads), block_size, head_dim)
    return payload, cache[:, :, heads.start : heads.stop]


def gather_into(segment: torch.Tensor, cache: torch.Tensor, view: RowView) -> None:
    """Copy the rows of ``cache`` into the byte tensor ``segment`` (exactly their size)."""
    if view.row_elems == 0:
        payload, source = _strided(segment, cache, view)
        torch.index_select(source, 0, view.rows, out=payload)
        return
    source = cache.view(-1, view.row_elems)
    target = segment.view(cache.dtype).view(-1, view.row_elems)
    torch.index_select(source, 0, view.rows, out=target)


def scatter_from(segment: torch.Tensor, cache: torch.Tensor, view: RowView) -> None:
    """Write the byte tensor ``segment`` into the rows of ``cache``."""
    if view.row_elems == 0:
        payload, target = _strided(segment, cache, view)
        target.index_copy_(0, view.rows, payload)
        return
    source = segment.view(cache.dtype).view(-1, view.row_elems)
    cache.view(-1, view.row_elems).index_copy_(0, view.rows, source)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work on ``device``: UCX reads and writes outside torch streams."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _size_class(nbytes: int) -> int:
    return max(_MIN_POOLED, 1 << max(nbytes - 1, 0).bit_length())


@dataclass
class BufferPool:
    """Byte buffers kept for reuse, by device and power-of-two size class; thread-safe.

    Holds at most ``max_cached_bytes`` idle; `acquire` returns a buffer of at least the asked
    size (slice it), `release` gives it back. A buffer UCX may still touch is never released.
    """

    max_cached_bytes: int
    _idle: dict[tuple[str, int], list[torch.Tensor]] = field(
        default_factory=lambda: defaultdict(list), init=False
    )
    _cached: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def acquire(self, nbytes: int, device: torch.device) -> torch.Tensor:
        size = _size_class(nbytes)
        with self._lock:
            idle = self._idle.get((str(device), size))
            if idle:
                self._cached -= size
                return idle.pop()
        return torch.empty(size, dtype=torch.uint8, device=device)

    def release(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        if size < _MIN_POOLED or size & (size - 1):
            return
        with self._lock:
            if self._cached + size > self.max_cached_bytes:
                return
            self._idle[(str(buffer.device), size)].append(buffer)
            self._cached += size

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._cached


def payload_checksum(payload: torch.Tensor) -> int | None:
    """xxh3-64 of a host payload; None for device memory (hashing it would cost a copy)."""
    if payload.is_cuda:
        return None
    return xxhash.xxh3_64_intdigest(memoryview(payload.numpy()))
