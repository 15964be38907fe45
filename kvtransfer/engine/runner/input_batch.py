"""Flatten a step's sequences into one batch of token rows with paged-attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.engine.model.forward_context import AttentionMetadata


@dataclass(frozen=True)
class SequenceChunk:
    """Tokens of one sequence to run this forward: ``token_ids`` at positions ``start..``."""

    token_ids: Sequence[int]
    start_position: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    # Row of each sequence's last token in input_ids.
    last_rows: torch.Tensor  # int64 [num_seqs]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_forward_batch(
    chunks: Sequence[SequenceChunk], block_size: int, device: torch.device | str
) -> ForwardBatch:
    """Positions, slots and block tables for ``chunks``; raises if a slot has no block."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    max_blocks = max((len(c.block_ids) for c in chunks), default=0)
    tables = torch.zeros((len(chunks), max(max_blocks, 1)), dtype=torch.int64)
    for i, chunk in enumerate(chunks):
        end = chunk.start_position + len(chunk.token_ids)
        if end > len(chunk.block_ids) * block_size:
            raise RuntimeError(
                f"sequence needs KV slots up to position {end - 1} but its block table covers "
                f"only {len(chunk.block_ids) * block_size} tokens"
            )
        pos = np.arange(chunk.start_position, end, dtype=np.int64)
        table = np.asarray(chunk.block_ids, dtype=np.int64)
        slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
        positions.extend(pos.tolist())
        input_ids.extend(chunk.token_ids)
        query_start.append(len(input_ids))
        seq_lens.append(end)
        tables[i, : len(chunk.block_ids)] = torch.as_tensor(list(chunk.block_ids))
    query_start_loc = torch.tensor(query_start, dtype=torch.int64)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        block_size=block_size,
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=metadata,
        last_rows=(query_start_loc[1:] - 1).to(device),
    )
