"""Paged attention against a per-sequence dense attention, and its metadata validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from engine_helpers.dense_reference import SeqChunk, paged_step

from kvtransfer.engine.model.attention import PagedAttentionPlan, paged_attention, write_kv
from kvtransfer.engine.model.forward_context import AttentionMetadata

pytestmark = pytest.mark.unit

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.., k/v [ctx, KV, D] at positions 0.."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        scores = q[:, h] @ k[:, h // group].T / math.sqrt(q.shape[-1])
        pos = torch.arange(q.shape[0])[:, None] + first_pos
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


@pytest.mark.parametrize("per_sequence", [False, True], ids=["padded", "per-sequence"])
def test_mixed_batch_matches_dense_attention_per_sequence(per_sequence):
    gen = torch.Generator().manual_seed(0)
    # (context length after the step, tokens computed before it, block table)
    layout = [(9, 0, [7, 2, 11]), (10, 9, [3, 0, 5]), (13, 5, [1, 4, 8, 6]), (6, 2, [10, 9])]
    cache = torch.zeros(12, 2, KV_HEADS, BLOCK, DIM)
    full_k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n, _, _ in layout]
    full_v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n, _, _ in layout]
    # KV of already computed tokens sits in the cache from earlier steps.
    for (_, done, blocks), k, v in zip(layout, full_k, full_v, strict=True):
        for pos in range(done):
            cache[blocks[pos // BLOCK], 0, :, pos % BLOCK] = k[pos]
            cache[blocks[pos // BLOCK], 1, :, pos % BLOCK] = v[pos]
    chunks = [SeqChunk([0] * n, done, blocks) for n, done, blocks in layout]
    step = paged_step(chunks, BLOCK)
    queries = [torch.randn(n - done, HEADS, DIM, generator=gen) for n, done, _ in layout]
    new_k = torch.cat([k[done:] for (_, done, _), k in zip(layout, full_k, strict=True)])
    new_v = torch.cat([v[done:] for (_, done, _), v in zip(layout, full_v, strict=True)])

    plan = PagedAttentionPlan.build(step.attn_metadata, new_k.shape[0], torch.device("cpu"))
    # 16 padded blocks for 12 read: gathered padded, unless forced one sequence at a time.
    assert not plan.per_sequence
    plan = dataclasses.replace(plan, per_sequence=per_sequence)
    out = paged_attention(torch.cat(queries), new_k, new_v, cache, plan, DIM**-0.5)

    expected = torch.cat(
        [
            _dense(q, k, v, done)
            for (_, done, _), q, k, v in zip(layout, queries, full_k, full_v, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every new token's K/V landed in its slot.
    slots = step.attn_metadata.slot_mapping
    torch.testing.assert_close(cache[slots // BLOCK, 0, :, slots % BLOCK], new_k)
    torch.testing.assert_close(cache[slots // BLOCK, 1, :, slots % BLOCK], new_v)


def test_a_batch_mixing_short_and_long_contexts_is_attended_one_sequence_at_a_time():
    # Decodes of 1, 1 and 12 blocks: 36 padded slots' blocks for 14 read.
    chunks = [
        SeqChunk([0] * 2, 1, [1]),
        SeqChunk([0] * 3, 2, [2]),
        SeqChunk([0] * 48, 47, list(range(3, 15))),
    ]
    step = paged_step(chunks, BLOCK)
    plan = PagedAttentionPlan.build(step.attn_metadata, 3, torch.device("cpu"))
    assert plan.per_sequence
    assert (plan.seq_blocks, plan.query_starts) == ((1, 1, 12), (0, 1, 2, 3))
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(16, 2, KV_HEADS, BLOCK, DIM, generator=gen)
    query = torch.randn(3, HEADS, DIM, generator=gen)
    new_kv = torch.randn(3, KV_HEADS, DIM, generator=gen)
    padded = paged_attention(
        query, new_kv, new_kv, cache.clone(), dataclasses.replace(plan, per_sequence=False), 0.3
    )
    torch.testing.assert_close(paged_attention(query, new_kv, new_kv, cache, plan, 0.3), padded)


def test_write_kv_touches_only_the_given_slots():
    cache = torch.zeros(3, 2, KV_HEADS, BLOCK, DIM)
    step = paged_step([SeqChunk([0] * 6, 4, [2, 0])], BLOCK)  # positions 4, 5 -> block 0
    plan = PagedAttentionPlan.build(step.attn_metadata, 2, torch.device("cpu"))
    key = torch.ones(2, KV_HEADS, DIM)
    write_kv(cache, key, -key, plan)
    assert cache[0, 0, :, :2].eq(1).all() and cache[0, 1, :, :2].eq(-1).all()
    assert int(cache.ne(0).sum()) == 2 * 2 * KV_HEADS * DIM


def _metadata(**overrides: object) -> AttentionMetadata:
    fields: dict[str, object] = {
        "slot_mapping": torch.tensor([0, 1, 2]),
        "query_start_loc": torch.tensor([0, 3]),
        "seq_lens": torch.tensor([3]),
        "block_tables": torch.tensor([[0]]),
        "block_size": 4,
    }
    fields.update(overrides)
    return AttentionMetadata(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"slot_mapping": torch.tensor([0, 1])}, r"slot_mapping has shape \(2,\), expected \(3,\)"),
        ({"query_start_loc": torch.tensor([0, 2])}, r"must run from 0 to num_tokens \(3\)"),
        ({"seq_lens": torch.tensor([2])}, r"seq_lens must be >= each sequence's query length"),
        (
            {"seq_lens": torch.tensor([5])},
            r"block_tables has 1 columns but a context of 5 tokens needs 2 blocks of 4",
        ),
        (
            {"block_tables": torch.tensor([0])},
            r"block_tables has shape \(1,\), expected \(1, max_blocks_per_seq\)",
        ),
        ({"block_size": 0}, r"block_size must be >= 1, got 0"),
    ],
)
def test_plan_rejects_inconsistent_metadata(overrides, message):
    with pytest.raises(ValueError, match=message):
        PagedAttentionPlan.build(_metadata(**overrides), 3, torch.device("cpu"))


def test_attention_rejects_a_cache_of_another_layout():
    plan = PagedAttentionPlan.build(_metadata(), 3, torch.device("cpu"))
    q = torch.zeros(3, HEADS, DIM)
    kv = torch.zeros(3, KV_HEADS, DIM)
    with pytest.raises(ValueError, match=r"kv_cache shape \(2, 2, 2, 8, 8\) does not match"):
        paged_attention(q, kv, kv, torch.zeros(2, 2, KV_HEADS, 8, DIM), plan, 1.0)
    with pytest.raises(ValueError, match=r"key/value shapes \(3, 3, 8\)/\(3, 2, 8\)"):
        cache = torch.zeros(2, 2, KV_HEADS, 4, DIM)
        paged_attention(q, torch.zeros(3, 3, DIM), kv, cache, plan, 1.0)
