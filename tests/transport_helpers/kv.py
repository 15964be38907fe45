"""Seeded KV caches that a server process and the test process build identically."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

NUM_BLOCKS = 64
NUM_HEADS = 4
BLOCK_SIZE = 16
HEAD_DIM = 8


@dataclass(frozen=True)
class LayerGroup:
    """Layers ``{prefix}.{i}.self_attn`` for ``i`` in ``[start, start + count)``."""

    prefix: str
    start: int
    count: int
    dtype: str = "float32"

    def names(self) -> list[str]:
        return [f"{self.prefix}.{i}.self_attn" for i in range(self.start, self.start + self.count)]

    def encode(self) -> str:
        return f"{self.prefix}:{self.start}:{self.count}:{self.dtype}"

    @classmethod
    def decode(cls, text: str) -> LayerGroup:
        prefix, start, count, dtype = text.split(":")
        return cls(prefix, int(start), int(count), dtype)


def layer_tensor(
    seed: int,
    name: str,
    dtype: str = "float32",
    *,
    num_blocks: int = NUM_BLOCKS,
    num_heads: int = NUM_HEADS,
) -> torch.Tensor:
    """The remote cache of layer ``name``: distinct, reproducible values per seed and layer."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(
        num_blocks, 2, num_heads, BLOCK_SIZE, HEAD_DIM, generator=generator, dtype=torch.float32
    )
    return values.to(getattr(torch, dtype))


def make_caches(seed: int, groups: list[LayerGroup]) -> dict[str, torch.Tensor]:
    return {
        name: layer_tensor(seed, name, group.dtype) for group in groups for name in group.names()
    }


def empty_caches(
    groups: list[LayerGroup], *, num_heads: int = NUM_HEADS, num_blocks: int = NUM_BLOCKS
) -> dict[str, torch.Tensor]:
    """Local caches filled with a sentinel so untouched blocks are recognisable."""
    return {
        name: torch.full(
            (num_blocks, 2, num_heads, BLOCK_SIZE, HEAD_DIM),
            -7.0,
            dtype=getattr(torch, group.dtype),
        )
        for group in groups
        for name in group.names()
    }


def in_order(tensor: torch.Tensor, order: str) -> torch.Tensor:
    """``tensor`` (``B2HND``) copied into memory laid out in axis ``order``, returned as its
    ``B2HND`` view: same values, other strides."""
    from kvtransfer.transport import KV_AXES, canonical_kv_view

    physical = tensor.permute(*(KV_AXES.index(axis) for axis in order)).contiguous()
    return canonical_kv_view(physical, order)
