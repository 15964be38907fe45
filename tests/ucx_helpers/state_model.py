"""vLLM-style recurrent-state pages of a synthetic Mamba2 or Gated DeltaNet layer, per TP rank.

A seeded "global" state per block (every conv channel at every position, every SSM head) is
what a model with all heads on one rank would hold; `StateModel.rank_pages` packs one TP
rank's share as vLLM does (``MambaBase.bind_kv_cache``): the rank's conv state (its heads of
each sub-projection, in order, as ``(positions, channels)`` or, ``dim_first``, ``(channels,
positions)``), then its SSM heads, then padding, in one int8 page per block. Built here by
slicing and concatenating tensors, independently of `kvtransfer.connector.state_parts`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvtransfer.connector.kv_groups import RECURRENT_STATE, KVCacheGroup
from kvtransfer.connector.state_parts import gdn_parts, mamba2_parts
from kvtransfer.connector.topology import kv_head_range

SENTINEL_BYTE = 7  # a consumer page before any load (`synthetic.sentinel_cache`'s fp8 byte)


@dataclass(frozen=True)
class StateModel:
    """``kind`` "mamba2": ``heads`` Mamba heads of ``head_dim``, ``groups`` B/C groups of
    ``state``. ``kind`` "gdn": ``heads`` value heads of ``head_dim``, ``groups`` key heads of
    ``state`` (q, k: by key head; v and the state ``[v heads, v_dim, k_dim]`` by value head)."""

    kind: str
    dim_first: bool
    heads: int = 4
    head_dim: int = 2
    groups: int = 2
    state: int = 4
    positions: int = 3
    num_blocks: int = 24
    pad: int = 24  # vLLM pads a state page to the attention page

    def sections(self) -> list[tuple[str, int, int]]:
        """The conv channels' sub-projections in order: (name, total heads, channels each)."""
        if self.kind == "mamba2":
            return [
                ("x", self.heads, self.head_dim),
                ("B", self.groups, self.state),
                ("C", self.groups, self.state),
            ]
        return [
            ("q", self.groups, self.state),
            ("k", self.groups, self.state),
            ("v", self.heads, self.head_dim),
        ]

    def global_state(self, seed: int, name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(name.encode()))
        conv = {
            section: torch.randn(self.num_blocks, self.positions, total, width, generator=generator)
            for section, total, width in self.sections()
        }
        ssm = torch.randn(
            self.num_blocks, self.heads, self.head_dim, self.state, generator=generator
        )
        return conv, ssm

    def rank_state(
        self, seed: int, name: str, tp: int, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's conv state ``[blocks, *conv_shape]`` and SSM state, float32."""
        conv, ssm = self.global_state(seed, name)
        channels = []
        for section, total, _ in self.sections():
            held = kv_head_range(rank, tp, total)
            channels.append(conv[section][:, :, held.start : held.stop].flatten(2))
        rank_conv = torch.cat(channels, dim=2)  # [blocks, positions, channels]
        if self.dim_first:
            rank_conv = rank_conv.transpose(1, 2)
        heads = kv_head_range(rank, tp, self.heads)
        return rank_conv.contiguous(), ssm[:, heads.start : heads.stop].contiguous()

    def page_bytes(self, tp: int) -> int:
        conv, ssm = self.rank_state(0, "shape", tp, 0)
        return (conv[0].numel() + ssm[0].numel()) * 4 + self.pad

    def rank_pages(self, name: str, tp: int, rank: int, seed: int | None) -> torch.Tensor:
        """A producer rank's pages (``seed``), or a consumer's before any load (None), as the
        adapter hands them: ``[blocks, 2, 1, 1, page / 2]`` uint8."""
        if seed is None:
            pages = torch.full((self.num_blocks, self.page_bytes(tp)), SENTINEL_BYTE)
            return pages.to(torch.uint8).view(self.num_blocks, 2, 1, 1, -1)
        conv, ssm = self.rank_state(seed, name, tp, rank)
        padding = torch.randint(
            0, 256, (self.num_blocks, self.pad), dtype=torch.uint8,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        pages = torch.cat([_bytes(conv), _bytes(ssm), padding], dim=1)
        return pages.view(self.num_blocks, 2, 1, 1, -1)

    def expected_pages(
        self, seed: int, name: str, tp: int, rank: int, pairs: list[tuple[int, int]]
    ) -> torch.Tensor:
        """A consumer rank's pages after loading producer block ``remote`` into ``local`` for
        each pair: conv and SSM bytes in place, padding and every other block untouched."""
        expected = self.rank_pages(name, tp, rank, None).reshape(self.num_blocks, -1).clone()
        conv, ssm = self.rank_state(seed, name, tp, rank)
        content = torch.cat([_bytes(conv), _bytes(ssm)], dim=1)
        for remote, local in pairs:
            expected[local, : content.shape[1]] = content[remote]
        return expected.view(self.num_blocks, 2, 1, 1, -1)

    def group(self, layers: tuple[str, ...], tp: int) -> KVCacheGroup:
        """The recurrent-state group the vLLM adapter would build for TP size ``tp``."""
        conv, ssm = self.rank_state(0, "shape", tp, 0)
        shapes = (tuple(conv.shape[1:]), tuple(ssm.shape[1:]))
        if self.kind == "mamba2":
            parts = mamba2_parts(
                *shapes, 4, 4, dim_first=self.dim_first, tp_size=tp, total_groups=self.groups
            )
        else:
            parts = gdn_parts(*shapes, 4, 4, dim_first=self.dim_first, tp_size=tp)
        return KVCacheGroup(RECURRENT_STATE, layers, state_parts=parts)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)
