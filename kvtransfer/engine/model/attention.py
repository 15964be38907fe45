"""Paged attention in plain torch (CPU and CUDA): write this step's K/V into the block pool, then
attend over each sequence's whole context with one ``scaled_dot_product_attention`` call.

One layer's cache is ``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` (index 0 = K,
1 = V), so a block holds every head's run of ``block_size`` tokens back to back. The batch is
ragged: sequence ``i`` brings ``query_len_i`` new tokens and reads ``seq_len_i`` context tokens,
the new ones being its last. Every sequence's context is gathered from its block table in one
indexing op, padded to the longest, and a boolean mask keeps query row ``j`` (absolute position
``seq_len_i - query_len_i + j``) to context positions ``<= j``'s position. That one rule covers
prefill, chunked prefill, prefix-cache hits, decode and speculative verification, mixed in any
batch. When the padding would be more than `PER_SEQUENCE_PADDING` times the context actually
read (a batch mixing short and long contexts: a decode serving a mixed workload), each sequence
is gathered and attended on its own instead, with the same mask rows: the gather copies every
context slot at every layer and step, so on a CPU it, not the attention's arithmetic, is what a
decode step pays for (a batch of 100-, 300-, 800- and 1500-token contexts: 161 ms a step padded,
92 ms each on its own, `builtin:small` on one core). A sliding-window layer's plan also hides
context positions ``<= position - window``, as transformers' sliding mask does; those positions'
blocks may already be back in the pool (or be the null block), which the mask makes harmless.

The index tensors depend only on `AttentionMetadata`, not on the layer, so `PagedAttentionPlan`
builds them once per forward and every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtransfer.engine.model.forward_context import AttentionMetadata

# Padded context slots over those read above which a batch is attended one sequence at a time.
PER_SEQUENCE_PADDING = 1.5


@dataclass(frozen=True)
class PagedAttentionPlan:
    """Index tensors for one forward pass, shared by all layers (all on the cache's device).

    Query rows are scattered into a ``[num_seqs, max_query_len]`` grid (``token_seq``,
    ``token_row``) so the whole batch is one attention call; ``context_blocks`` are the blocks
    to gather per sequence and ``mask`` says which gathered slots each grid row may see.
    """

    num_tokens: int
    num_seqs: int
    max_query_len: int
    block_size: int
    write_blocks: torch.Tensor  # int64 [num_tokens]
    write_offsets: torch.Tensor  # int64 [num_tokens]
    token_seq: torch.Tensor  # int64 [num_tokens]
    token_row: torch.Tensor  # int64 [num_tokens]
    context_blocks: torch.Tensor  # int64 [num_seqs, blocks_per_context]
    mask: torch.Tensor  # bool [num_seqs, 1, max_query_len, blocks_per_context * block_size]
    # Host copies for the per-sequence path: query row starts (num_seqs + 1) and context blocks.
    query_starts: tuple[int, ...] = ()
    seq_blocks: tuple[int, ...] = ()
    per_sequence: bool = False

    @classmethod
    def build(
        cls,
        attn_metadata: AttentionMetadata,
        num_tokens: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> PagedAttentionPlan:
        """Validate ``attn_metadata`` against ``num_tokens`` rows and precompute the indices."""
        md = attn_metadata
        block_size = md.block_size
        if block_size < 1:
            raise ValueError(f"attn_metadata.block_size must be >= 1, got {block_size}")
        num_seqs = md.num_seqs
        if tuple(md.slot_mapping.shape) != (num_tokens,):
            raise ValueError(
                f"attn_metadata.slot_mapping has shape {tuple(md.slot_mapping.shape)}, "
                f"expected ({num_tokens},) (one slot per token)"
            )
        if tuple(md.query_start_loc.shape) != (num_seqs + 1,):
            raise ValueError(
                f"attn_metadata.query_start_loc has shape {tuple(md.query_start_loc.shape)}, "
                f"expected ({num_seqs + 1},) for {num_seqs} sequences"
            )
        if md.block_tables.dim() != 2 or md.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"attn_metadata.block_tables has shape {tuple(md.block_tables.shape)}, "
                f"expected ({num_seqs}, max_blocks_per_seq)"
            )
        # The only host syncs of the forward pass: shapes below depend on these values.
        starts = md.query_start_loc.to("cpu", torch.int64)
        seq_lens_cpu = md.seq_lens.to("cpu", torch.int64)
        query_lens_cpu = starts[1:] - starts[:-1]
        if num_seqs and (int(starts[0]) != 0 or int(starts[-1]) != num_tokens):
            raise ValueError(
                f"attn_metadata.query_start_loc must run from 0 to num_tokens ({num_tokens}), "
                f"got {starts.tolist()}"
            )
        if bool((query_lens_cpu < 0).any()):
            raise ValueError(
                f"attn_metadata.query_start_loc must be non-decreasing, got {starts.tolist()}"
            )
        if bool((seq_lens_cpu < query_lens_cpu).any()):
            raise ValueError(
                "attn_metadata.seq_lens must be >= each sequence's query length, got seq_lens "
                f"{seq_lens_cpu.tolist()} for query lengths {query_lens_cpu.tolist()}"
            )
        max_seq_len = int(seq_lens_cpu.max()) if num_seqs else 0
        max_query_len = int(query_lens_cpu.max()) if num_seqs else 0
        blocks_per_context = -(-max_seq_len // block_size)
        if blocks_per_context > md.block_tables.shape[1]:
            raise ValueError(
                f"attn_metadata.block_tables has {md.block_tables.shape[1]} columns but a "
                f"context of {max_seq_len} tokens needs {blocks_per_context} blocks of "
                f"{block_size}"
            )

        slots = md.slot_mapping.to(device, torch.int64)
        seq_lens = seq_lens_cpu.to(device)
        query_lens = query_lens_cpu.to(device)
        token_seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
        )
        token_row = torch.arange(num_tokens, device=device) - starts.to(device)[token_seq]
        first_pos = seq_lens - query_lens
        query_pos = first_pos[:, None] + torch.arange(max_query_len, device=device)[None, :]
        # Grid rows past a sequence's query length act as its last token: with a sliding window
        # they would otherwise see nothing, and a row of -inf scores is NaN.
        query_pos = torch.minimum(query_pos, (seq_lens - 1).clamp(min=0)[:, None])
        context_pos = torch.arange(blocks_per_context * block_size, device=device)
        # Grid rows past a sequence's query length are dropped after attention.
        mask = (context_pos[None, None, :] <= query_pos[:, :, None]) & (
            context_pos[None, None, :] < seq_lens[:, None, None]
        )
        if sliding_window is not None:
            mask &= context_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        seq_blocks = tuple(-(-n // block_size) for n in seq_lens_cpu.tolist())
        padded = num_seqs * blocks_per_context
        return cls(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max_query_len,
            block_size=block_size,
            write_blocks=torch.div(slots, block_size, rounding_mode="floor"),
            write_offsets=torch.remainder(slots, block_size),
            token_seq=token_seq,
            token_row=token_row,
            context_blocks=md.block_tables[:, :blocks_per_context].to(device, torch.int64),
            mask=mask.unsqueeze(1),
            query_starts=tuple(starts.tolist()),
            seq_blocks=seq_blocks,
            per_sequence=num_seqs > 1 and padded > PER_SEQUENCE_PADDING * sum(seq_blocks),
        )


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PagedAttentionPlan
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at the plan's slots."""
    # Indices split by a slice put the token dim first, matching key's [tokens, heads, dim].
    kv_cache[plan.write_blocks, 0, :, plan.write_offsets] = key.to(kv_cache.dtype)
    kv_cache[plan.write_blocks, 1, :, plan.write_offsets] = value.to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: PagedAttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V, then attend: ``query`` ``[num_tokens, num_heads, head_dim]`` ->
    output of the same shape. ``num_heads`` must be a multiple of the cache's KV heads; query
    heads ``g*h .. g*h+g-1`` share KV head ``h``."""
    num_tokens, num_heads, head_dim = query.shape
    _, two, num_kv_heads, block_size, cache_head_dim = kv_cache.shape
    if two != 2 or block_size != plan.block_size or cache_head_dim != head_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match (num_blocks, 2, "
            f"num_kv_heads, {plan.block_size}, {head_dim})"
        )
    if num_tokens != plan.num_tokens:
        raise ValueError(f"query has {num_tokens} rows, the plan {plan.num_tokens}")
    expected_kv = (num_tokens, num_kv_heads, head_dim)
    if tuple(key.shape) != expected_kv or tuple(value.shape) != expected_kv:
        raise ValueError(
            f"key/value shapes {tuple(key.shape)}/{tuple(value.shape)} do not match the "
            f"cache's (num_tokens, num_kv_heads, head_dim) = {expected_kv}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    write_kv(kv_cache, key, value, plan)
    if plan.num_seqs == 0:
        return query.new_zeros(query.shape)

    group = num_heads // num_kv_heads
    if plan.per_sequence:
        return _attend_each(query, kv_cache, plan, group, scale)
    num_seqs, max_q = plan.num_seqs, plan.max_query_len
    grid = query.new_zeros(num_seqs, max_q, num_heads, head_dim)
    grid[plan.token_seq, plan.token_row] = query
    # Fold each KV head's query heads into the query-length axis: one KV copy serves them all
    # with no repeat of the gathered context.
    q = grid.view(num_seqs, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * max_q, head_dim)

    context = kv_cache[plan.context_blocks]  # [seqs, blocks, 2, kv_heads, block_size, dim]
    context = context.permute(2, 0, 3, 1, 4, 5).reshape(2, num_seqs, num_kv_heads, -1, head_dim)
    k, v = context[0].to(query.dtype), context[1].to(query.dtype)
    mask = plan.mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs, max_q, num_heads, head_dim)
    return out[plan.token_seq, plan.token_row]


def _attend_each(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: PagedAttentionPlan, group: int, scale: float
) -> torch.Tensor:
    """`paged_attention` one sequence at a time: each gathers only its own context blocks."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    # [2, kv_heads, blocks, block_size, dim]: selecting blocks on this view copies once, straight
    # into the layout attention reads (K/V, head, then tokens).
    by_head = kv_cache.permute(1, 2, 0, 3, 4)
    out = query.new_zeros(query.shape)
    starts = plan.query_starts
    for seq, num_blocks in enumerate(plan.seq_blocks):
        first, end = starts[seq], starts[seq + 1]
        rows = end - first
        if rows == 0:
            continue
        slots = num_blocks * block_size
        context = by_head.index_select(2, plan.context_blocks[seq, :num_blocks])
        context = context.view(2, num_kv_heads, slots, head_dim).to(query.dtype)
        q = query[first:end].view(rows, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * rows, head_dim)
        mask = plan.mask[seq, 0, :rows, :slots].repeat(group, 1)
        o = F.scaled_dot_product_attention(q, context[0], context[1], attn_mask=mask, scale=scale)
        o = o.view(num_kv_heads, group, rows, head_dim).permute(2, 0, 1, 3)
        out[first:end] = o.reshape(rows, num_heads, head_dim)
    return out
