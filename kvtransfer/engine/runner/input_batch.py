"""Flatten a step's sequences into one batch of token rows with paged-attention metadata."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.engine.model.forward_context import AttentionMetadata


@dataclass(frozen=True)
class SequenceChunk:
    """Tokens of one sequence to run this forward: ``token_ids`` at positions ``start..``.

    ``block_ids`` is KV cache group 0's table; ``window_block_ids`` one table per further group
    (a hybrid model's sliding-window layers)."""

    token_ids: Sequence[int]
    start_position: int
    block_ids: Sequence[int]
    window_block_ids: tuple[Sequence[int], ...] = ()


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn_metadata: AttentionMetadata
    # Row of each sequence's last token in input_ids.
    last_rows: torch.Tensor  # int64 [num_seqs]
    # One per further KV cache group: the same rows, that group's slots and tables.
    window_metadata: tuple[AttentionMetadata, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def group_metadata(self) -> tuple[AttentionMetadata, ...]:
        """Every KV cache group's metadata, group 0 first (what the model takes)."""
        return (self.attn_metadata, *self.window_metadata)


def build_forward_batch(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    device: torch.device | str,
    state_groups: Collection[int] = (),
) -> ForwardBatch:
    """Positions, slots and block tables for ``chunks``; raises if a slot has no block.

    A group in ``state_groups`` (recurrent state) has one block per sequence, whatever its
    length: its metadata's ``block_tables[:, 0]`` is that block and no slot is written."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    for chunk in chunks:
        end = chunk.start_position + len(chunk.token_ids)
        positions.extend(range(chunk.start_position, end))
        input_ids.extend(chunk.token_ids)
        query_start.append(len(input_ids))
        seq_lens.append(end)
    query_start_loc = torch.tensor(query_start, dtype=torch.int64)
    num_groups = 1 + max((len(c.window_block_ids) for c in chunks), default=0)
    metadata = [
        _group_metadata(
            chunks,
            [c.block_ids if g == 0 else c.window_block_ids[g - 1] for c in chunks],
            query_start_loc,
            seq_lens,
            block_size,
            device,
            is_state=g in state_groups,
        )
        for g in range(num_groups)
    ]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=metadata[0],
        last_rows=(query_start_loc[1:] - 1).to(device),
        window_metadata=tuple(metadata[1:]),
    )


def _group_metadata(
    chunks: Sequence[SequenceChunk],
    tables: Sequence[Sequence[int]],
    query_start_loc: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    device: torch.device | str,
    is_state: bool = False,
) -> AttentionMetadata:
    slots: list[int] = []
    max_blocks = max((len(t) for t in tables), default=0)
    block_tables = torch.zeros((len(chunks), max(max_blocks, 1)), dtype=torch.int64)
    for i, (chunk, block_ids) in enumerate(zip(chunks, tables, strict=True)):
        end = chunk.start_position + len(chunk.token_ids)
        block_tables[i, : len(block_ids)] = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if is_state:
            if len(block_ids) != 1:
                raise RuntimeError(f"a recurrent state needs one block, got {list(block_ids)}")
            continue
        if end > len(block_ids) * block_size:
            raise RuntimeError(
                f"sequence needs KV slots up to position {end - 1} but its block table covers "
                f"only {len(block_ids) * block_size} tokens"
            )
        pos = np.arange(chunk.start_position, end, dtype=np.int64)
        table = np.asarray(block_ids, dtype=np.int64)
        slots.extend((table[pos // block_size] * block_size + pos % block_size).tolist())
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        block_size=block_size,
    )
