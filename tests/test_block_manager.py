"""BlockManager: reference counts, chained prefix-cache hashes, LRU eviction, leak checks."""

from __future__ import annotations

import pytest
from engine_helpers.scheduler_helpers import make_request

from kvtransfer.engine.scheduler.block_manager import (
    BlockLeakError,
    BlockManager,
    hash_block_tokens,
)

pytestmark = pytest.mark.unit


def _req(rid: str, tokens: list[int], computed: int = 0):
    request = make_request(rid, tokens)
    request.num_computed_tokens = computed
    return request


def _run(bm: BlockManager, rid: str, tokens: list[int]):
    """Admit ``tokens`` with whatever prefix hits exist, compute them all and publish."""
    request = _req(rid, tokens)
    hits, num_hit = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, len(tokens) - num_hit, hits) is not None
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request, len(tokens))
    return request


def test_allocate_counts_refs_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    request = _req("a", list(range(10)))
    assert bm.allocate_slots(request, 10) == [0, 1, 2]
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (3, 5, 3 / 8)
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    # Growing within the last block adds nothing; crossing a boundary adds one block.
    request.num_computed_tokens = 10
    assert bm.allocate_slots(request, 2) == []
    assert bm.allocate_slots(request, 3) == [3]
    assert bm.allocate_slots(request, 0, num_lookahead_tokens=6) == []
    assert bm.allocate_slots(request, 0, num_lookahead_tokens=7) == [4]
    assert bm.get_block_ids("a") == [0, 1, 2, 3, 4]
    bm.free("a")
    assert bm.get_block_ids("a") == []
    assert bm.num_free_blocks == 8
    bm.free("a")  # freeing twice (or an unknown id) is a no-op
    bm.check_no_leaks()


def test_prefix_hit_shares_blocks_with_ref_count_two():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _run(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 30, 31])
    hits, num_hit = bm.get_computed_blocks(b)
    assert (hits, num_hit) == ([0, 1], 8)
    assert bm.allocate_slots(b, 2, hits) == [0, 1, 3]
    assert [bm.ref_count(blk) for blk in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert bm.num_used_blocks == 4
    bm.free(a.request_id)
    assert [bm.ref_count(blk) for blk in (0, 1, 2)] == [1, 1, 0]
    bm.free(b.request_id)
    bm.check_no_leaks()


def test_hashes_are_chained_so_equal_content_after_another_prefix_is_no_hit():
    first = hash_block_tokens(b"", [1, 2, 3, 4])
    other_first = hash_block_tokens(b"", [9, 9, 9, 9])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(other_first, [5, 6, 7, 8])

    bm = BlockManager(num_blocks=8, block_size=4)
    _run(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    c = _run(bm, "c", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    # c's second block holds the same tokens as a's, yet is a separate cache entry.
    assert bm.num_cached_blocks == 4
    assert bm.get_block_ids("c") == [3, 4, 5]
    probe = _req("p", [9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert bm.get_computed_blocks(probe) == ([3, 4], 8)
    probe = _req("q", [0, 0, 0, 0, 5, 6, 7, 8, 1])
    assert bm.get_computed_blocks(probe) == ([], 0)
    bm.free("a")
    bm.free(c.request_id)
    bm.check_no_leaks()


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _run(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(_req("b", [1, 2, 3, 4, 5, 6, 7, 8])) == ([0], 4)
    assert bm.get_computed_blocks(_req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == ([0, 1], 8)
    assert bm.get_computed_blocks(_req("d", [1, 2, 3, 4])) == ([], 0)
    bm.free(a.request_id)
    bm.check_no_leaks()


def test_only_computed_full_blocks_are_published():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(11)))
    bm.allocate_slots(a, 11)
    bm.cache_full_blocks(a, 7)
    assert bm.num_cached_blocks == 1
    bm.cache_full_blocks(a, 11)
    assert bm.num_cached_blocks == 2
    bm.free("a")
    bm.check_no_leaks()


def test_freed_blocks_are_evicted_least_recently_freed_first_tail_before_head():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = _run(bm, "a", [*range(12), 50])  # blocks 0, 1, 2 full and cached, 3 partial
    b = _run(bm, "b", [40, 41, 42])  # block 4
    assert bm.num_free_blocks == 0
    bm.free(a.request_id)  # free order: 3, 2, 1, 0
    bm.free(b.request_id)  # then 4
    # Cache hits survive the free: the blocks only leave the cache when reused.
    assert bm.get_computed_blocks(_req("probe", list(range(13)))) == ([0, 1, 2], 12)
    c = _req("c", [60, 61, 62, 63, 64])
    assert bm.allocate_slots(c, 5) == [3, 2]
    assert bm.get_computed_blocks(_req("probe2", list(range(13)))) == ([0, 1], 8)
    d = _req("d", [70])
    assert bm.allocate_slots(d, 1) == [1]
    assert bm.get_computed_blocks(_req("probe3", list(range(13)))) == ([0], 4)
    bm.free("c")
    bm.free("d")
    bm.check_no_leaks()


def test_hit_on_free_block_takes_it_off_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _run(bm, "a", [1, 2, 3, 4, 5])
    bm.free(a.request_id)  # free order: 0..3 untouched first (2, 3), then 1, 0
    b = _req("b", [1, 2, 3, 4, 6])
    hits, _ = bm.get_computed_blocks(b)
    assert hits == [0]
    assert bm.allocate_slots(b, 1, hits) == [0, 2]
    assert bm.num_free_blocks == 2
    # Block 0 is in use, so filling the pool must not hand it out again.
    c = _req("c", list(range(20, 28)))
    assert bm.allocate_slots(c, 8) == [3, 1]
    assert bm.num_free_blocks == 0
    bm.free("b")
    bm.free("c")
    bm.check_no_leaks()


def test_evict_blocks_drops_them_from_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _run(bm, "a", list(range(9)))
    bm.evict_blocks([1])
    assert bm.get_computed_blocks(_req("b", list(range(9)))) == ([0], 4)
    bm.evict_blocks([0, 5])  # evicting an uncached block is a no-op
    assert bm.get_computed_blocks(_req("c", list(range(9)))) == ([], 0)
    # Once dropped, republishing the same request does not bring them back.
    bm.cache_full_blocks(a, 9)
    assert bm.num_cached_blocks == 0
    with pytest.raises(ValueError, match=r"^block id 8 out of range \[0, 8\)$"):
        bm.evict_blocks([8])
    bm.free(a.request_id)
    bm.check_no_leaks()


def test_allocation_that_does_not_fit_returns_none_without_side_effects():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _run(bm, "a", list(range(9)))  # blocks 0, 1 cached; 2 partial
    bm.free(a.request_id)
    b = _req("b", list(range(20, 24)))
    bm.allocate_slots(b, 4)  # takes block 3 (never used)
    assert bm.can_allocate(3) and not bm.can_allocate(4)
    c = _req("c", list(range(9)) + [99] * 8)
    hits, num_hit = bm.get_computed_blocks(c)
    assert (hits, num_hit) == ([0, 1], 8)
    # 2 hits on free blocks + 3 fresh blocks > 3 free blocks.
    assert bm.allocate_slots(c, 9, hits) is None
    assert bm.get_block_ids("c") == []
    assert (bm.num_free_blocks, bm.ref_count(0), bm.ref_count(1)) == (3, 0, 0)
    assert bm.get_computed_blocks(c) == ([0, 1], 8)
    assert bm.allocate_slots(c, 4, hits) == [0, 1, 2]
    bm.free("b")
    bm.free("c")
    bm.check_no_leaks()


def test_hits_only_on_an_empty_table_and_counts_must_be_non_negative():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _run(bm, "a", list(range(9)))
    with pytest.raises(
        ValueError,
        match=r"^request a: prefix-cache hits can only be added to an empty block table, it "
        r"already holds 3 blocks$",
    ):
        bm.allocate_slots(a, 1, [0])
    with pytest.raises(
        ValueError,
        match=r"^request a: num_new_tokens \(-1\) and num_lookahead_tokens \(0\) must be >= 0$",
    ):
        bm.allocate_slots(a, -1)
    bm.free("a")
    bm.check_no_leaks()


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    _run(bm, "a", list(range(9)))
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    bm.free("a")
    bm.check_no_leaks()


def test_reset_prefix_cache_forgets_hashes_but_keeps_tables():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _run(bm, "a", list(range(9)))
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.get_block_ids("a") == [0, 1, 2]
    assert bm.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    bm.cache_full_blocks(a, 9)  # still-valid blocks may be published again
    assert bm.get_computed_blocks(_req("c", list(range(9)))) == ([0, 1], 8)
    bm.free("a")
    bm.check_no_leaks()


def test_check_no_leaks_names_requests_and_referenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    _run(bm, "a", list(range(9)))
    b = _req("b", list(range(9)))
    hits, _ = bm.get_computed_blocks(b)
    bm.allocate_slots(b, 1, hits)
    with pytest.raises(BlockLeakError) as info:
        bm.check_no_leaks()
    assert str(info.value) == (
        "KV block leak: request 'a' holds blocks [0, 1, 2]; request 'b' holds blocks [0, 1, 3]; "
        "blocks with ref count > 0: 0 (ref 2), 1 (ref 2), 2 (ref 1), 3 (ref 1)"
    )
    assert isinstance(info.value, RuntimeError)
    bm.free("a")
    bm.free("b")
    bm.check_no_leaks()


def test_constructor_validates_sizes():
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 1, got 0$"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got 0$"):
        BlockManager(num_blocks=4, block_size=0)
