"""What one forward pass needs besides token ids: where each token's KV goes, which blocks each
sequence reads, and the connector's per-layer hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Paged-attention inputs for a batch of sequences flattened into ``num_tokens`` rows.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; after this step
    its context is ``seq_lens[i]`` tokens long (cached + new), the new ones being the last
    ``query_len`` of them. ``block_tables[i]`` lists its blocks (padded with 0).
    ``slot_mapping[t] = block_id * block_size + offset`` is where row ``t``'s K/V is written.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor  # int64 [num_seqs]
    block_tables: torch.Tensor  # int64 [num_seqs, max_blocks_per_seq]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class LayerHooks(Protocol):
    """Called by the model around every attention layer (the KV connector's layer hooks)."""

    def before_attention(self, layer_name: str) -> None:
        """Before ``layer_name`` reads its paged cache (``wait_for_layer_load``)."""

    def after_attention(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """After ``layer_name`` wrote this step's K/V into ``kv_cache`` (``save_kv_layer``)."""


class NoLayerHooks:
    def before_attention(self, layer_name: str) -> None:
        pass

    def after_attention(
        self, layer_name: str, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        pass
