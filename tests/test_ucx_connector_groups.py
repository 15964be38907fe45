"""Hybrid KV caches through `UcxConnector`: one block list per KV cache group, over real UCX.

Two synthetic engines whose layers are two groups (layers 1 and 3 full attention, 0 and 2 a
16-token sliding window over 8-token blocks, so a transfer keeps cdiv(16, 8) + 1 = 3 blocks of
that group), with vLLM's null block 0 in front of a sliding window: what the producer holds and
lends, which bytes land where on the consumer (byte for byte, and nothing else written), and the
typed refusals (groups that differ between the engines, block lists that do not match them).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ucx_helpers.synthetic import (
    BLOCK_SIZE,
    SENTINEL,
    STATE_WIDTH,
    engines,
    global_layer,
    run_load,
    sentinel_cache,
    state_pages,
)

from kvtransfer.connector.base import supports_hma
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.kv_groups import (
    FULL_ATTENTION,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    KVCacheGroup,
    as_block_ids,
    num_listed_blocks,
    transferable_blocks,
)
from kvtransfer.connector.metadata import KVCacheLayout, KVConnectorRole
from kvtransfer.connectors.multi import MultiConnector
from kvtransfer.connectors.ucx import UcxConnectorMetadata

pytestmark = pytest.mark.integration

SEED = 11
FULL = ("model.layers.1.self_attn", "model.layers.3.self_attn")
WINDOWED = ("model.layers.0.self_attn", "model.layers.2.self_attn")


def hybrid(window: int = 16) -> tuple[KVCacheGroup, ...]:
    return (
        KVCacheGroup(FULL_ATTENTION, FULL),
        KVCacheGroup(SLIDING_WINDOW, WINDOWED, window),
    )


def request(rid: str, num_tokens: int, params: dict | None) -> SimpleNamespace:
    prompt = list(range(100, 100 + num_tokens))
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        num_tokens=num_tokens,
        num_computed_tokens=num_tokens,
    )


# 6 blocks of prompt (44 tokens): the producer's window group already dropped blocks 0-2.
PROMPT_TOKENS = 44
PRODUCER_BLOCKS = ((3, 4, 5, 6, 7, 8), (0, 0, 0, 9, 10, 11))
CONSUMER_BLOCKS = ((13, 14, 15, 16, 17, 18), (0, 0, 0, 19, 20, 21))


def test_a_group_moves_what_its_kind_keeps():
    full, window = hybrid()
    assert transferable_blocks(full, [3, 4, 5, 6], 24, 8, 0) == (3, 4, 5)
    assert transferable_blocks(window, [0, 0, 7, 8, 9], 40, 8, 0) == (7, 8, 9)
    assert transferable_blocks(window, [0, 6, 7, 8, 9], 33, 8, 0) == (7, 8, 9)
    assert transferable_blocks(window, [5, 6], 16, 8, 0) == (5, 6)
    with pytest.raises(ValueError, match="null block at position 0 of a full-attention"):
        transferable_blocks(full, [0, 4], 16, 8, 0)
    with pytest.raises(ValueError, match="null block inside the blocks to move"):
        transferable_blocks(window, [0, 5, 0, 6], 32, 8, 0)
    with pytest.raises(ValueError, match=r"window 16\).*: 1 blocks listed, 2 needed"):
        transferable_blocks(window, [5], 9, 8, 0)
    with pytest.raises(ValueError, match="sliding_window group needs sliding_window"):
        KVCacheGroup(SLIDING_WINDOW, WINDOWED)
    assert (num_listed_blocks([4, 5]), num_listed_blocks([[4, 5], [6]])) == (2, 3)
    assert as_block_ids([1, 2], 1) == ((1, 2),)
    assert as_block_ids([[1], [2]], 2) == ((1,), (2,))
    with pytest.raises(ValueError, match=r"1 block list\(s\) for an engine with 2 KV cache"):
        as_block_ids([1, 2], 2)


def runs(spec) -> list[tuple]:
    return [(r.group, r.remote_block_ids, r.local_block_ids, r.lease_offset) for r in spec.runs]


def _producer_params(p, blocks=PRODUCER_BLOCKS) -> dict:
    """Finish a prefill of `PROMPT_TOKENS` on ``p`` and grant its lease, as the engine would."""
    half = p.scheduler
    delay_free, params = half.request_finished_all_groups(
        request("pre", PROMPT_TOKENS, {"do_remote_decode": True}), blocks
    )
    assert delay_free
    meta = half.build_connector_meta(SimpleNamespace())
    p.step(grants=meta.grants)
    return params


def _consumer_load(c, params: dict, local_hit: int = 0, blocks=CONSUMER_BLOCKS):
    half = c.scheduler
    req = request("dec", PROMPT_TOKENS, params)
    req.num_computed_tokens = local_hit
    count, is_async = half.get_num_new_matched_tokens(req, local_hit)
    assert (count, is_async) == (PROMPT_TOKENS - local_hit, True)
    half.update_state_after_alloc(req, blocks, count)
    meta: UcxConnectorMetadata = half.build_connector_meta(SimpleNamespace())
    (spec,) = meta.loads
    return spec


@pytest.mark.parametrize("plane", ["rma", "tagged"])
def test_each_group_lands_in_its_own_blocks_and_nothing_else_is_written(plane):
    with engines(
        dict(engine_id="hp", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=hybrid(), data_plane=plane),
        dict(engine_id="hc", tp=1, pp=1, role="kv_consumer", draft=False, groups=hybrid(),
             data_plane=plane),
    ) as (p, c):  # fmt: skip
        params = _producer_params(p)
        # NIXL's wire shape: one list per group; the window's tail without the null blocks.
        assert params["remote_block_ids"] == [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
        spec = _consumer_load(c, params)
        assert runs(spec) == [
            (0, (3, 4, 5, 6, 7, 8), (13, 14, 15, 16, 17, 18), 0),
            (1, (9, 10, 11), (19, 20, 21), 6),
        ]  # fmt: skip
        assert run_load(c, spec) == {(0, 0): ({"dec"}, set(), set())}
        stats = c.workers[(0, 0)].get_kv_connector_stats().data
        # Per block and layer: K and V of 2 heads x 8 tokens x 4 floats.
        per_block = 2 * 2 * BLOCK_SIZE * 4 * 4
        assert stats["bytes_received_sliding_window"] == 3 * len(WINDOWED) * per_block
        assert stats["bytes_received"] == (6 * len(FULL) + 3 * len(WINDOWED)) * per_block
        caches = c.caches[(0, 0)]
        for names, pairs in (
            (FULL, list(zip(PRODUCER_BLOCKS[0], CONSUMER_BLOCKS[0], strict=True))),
            (WINDOWED, [(9, 19), (10, 20), (11, 21)]),
        ):
            for name in names:
                source = global_layer(SEED, name)
                expected = torch.full_like(source, SENTINEL)
                for remote, local in pairs:
                    expected[local] = source[remote]
                assert torch.equal(caches[name], expected), name


def test_a_prefix_hit_moves_only_the_missing_blocks_of_each_group():
    with engines(
        dict(engine_id="hp2", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=hybrid()),
        dict(engine_id="hc2", tp=1, pp=1, role="kv_consumer", draft=False, groups=hybrid()),
    ) as (p, c):  # fmt: skip
        spec = _consumer_load(c, _producer_params(p), local_hit=4 * BLOCK_SIZE)
        assert runs(spec) == [
            (0, (7, 8), (17, 18), 4),
            (1, (10, 11), (20, 21), 7),
        ]  # fmt: skip
        assert run_load(c, spec) == {(0, 0): ({"dec"}, set(), set())}


def test_engines_whose_groups_differ_fail_the_load_naming_both():
    with engines(
        dict(engine_id="wp", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=hybrid(window=16)),
        dict(engine_id="wc", tp=1, pp=1, role="kv_consumer", draft=False,
             groups=hybrid(window=24)),
    ) as (p, c):  # fmt: skip
        spec = _consumer_load(c, _producer_params(p))
        assert run_load(c, spec)[(0, 0)][1] == {"dec"}
        reason = c.workers[(0, 0)].get_load_failure_reasons()["dec"]
        assert (
            "layer 'model.layers.0.self_attn' is sliding_window:16 on engine 'wp'" in reason
            and "sliding_window:24 on this engine" in reason
        ), reason
        assert torch.all(c.caches[(0, 0)]["model.layers.1.self_attn"] == SENTINEL)


def test_block_lists_that_do_not_match_the_groups_are_refused():
    with engines(
        dict(engine_id="bp", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=hybrid()),
        dict(engine_id="bc", tp=1, pp=1, role="kv_consumer", draft=False, groups=hybrid()),
    ) as (p, c):  # fmt: skip
        with pytest.raises(ValueError, match=r"1 block list\(s\) for an engine with 2 KV cache"):
            p.scheduler.request_finished_all_groups(
                request("x", PROMPT_TOKENS, {"do_remote_decode": True}), (PRODUCER_BLOCKS[0],)
            )
        params = _producer_params(p)
        flat = {**params, "remote_block_ids": params["remote_block_ids"][0]}
        with pytest.raises(ValueError, match=r"holds 1 block list\(s\); this engine has 2"):
            c.scheduler.get_num_new_matched_tokens(request("d", PROMPT_TOKENS, flat), 0)


# Recurrent state: layers 0 and 2 Mamba-like (one state page per request), 1 and 3 attention.
STATE = ("model.layers.0.self_attn", "model.layers.2.self_attn")


def with_state() -> tuple[KVCacheGroup, ...]:
    return (
        KVCacheGroup(RECURRENT_STATE, STATE),
        KVCacheGroup(FULL_ATTENTION, FULL),
    )


# The producer's state block is 9, the consumer's 19 (vLLM lists one per request).
STATE_PRODUCER = ((9,), (3, 4, 5, 6, 7, 8))
STATE_CONSUMER = ((19,), (13, 14, 15, 16, 17, 18))


@pytest.mark.parametrize("plane", ["rma", "tagged"])
def test_a_state_page_moves_whole_beside_the_kv_blocks(plane):
    with engines(
        dict(engine_id="sp", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=with_state(), data_plane=plane),
        dict(engine_id="sc", tp=1, pp=1, role="kv_consumer", draft=False, groups=with_state(),
             data_plane=plane),
    ) as (p, c):  # fmt: skip
        params = _producer_params(p, STATE_PRODUCER)
        assert params["remote_block_ids"] == [[9], [3, 4, 5, 6, 7, 8]]
        spec = _consumer_load(c, params, blocks=STATE_CONSUMER)
        assert runs(spec) == [(0, (9,), (19,), 0), (1, STATE_PRODUCER[1], STATE_CONSUMER[1], 1)]
        assert run_load(c, spec) == {(0, 0): ({"dec"}, set(), set())}
        stats = c.workers[(0, 0)].get_kv_connector_stats().data
        assert stats["bytes_received_recurrent_state"] == len(STATE) * 2 * STATE_WIDTH
        caches = c.caches[(0, 0)]
        for name in STATE:
            expected = sentinel_cache(caches[name].shape, "fp8")
            expected[19] = state_pages(SEED, name)[9]
            assert torch.equal(caches[name], expected), name
        for name in FULL:
            source = global_layer(SEED, name)
            expected = torch.full_like(source, SENTINEL)
            for remote, local in zip(STATE_PRODUCER[1], STATE_CONSUMER[1], strict=True):
                expected[local] = source[remote]
            assert torch.equal(caches[name], expected), name


def test_state_between_tp_sizes_is_refused_naming_both():
    with engines(
        dict(engine_id="s2", tp=2, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=with_state()),
        dict(engine_id="s1", tp=1, pp=1, role="kv_consumer", draft=False, groups=with_state()),
    ) as (p, c):  # fmt: skip
        spec = _consumer_load(c, _producer_params(p, STATE_PRODUCER), blocks=STATE_CONSUMER)
        assert run_load(c, spec)[(0, 0)][1] == {"dec"}
        reason = c.workers[(0, 0)].get_load_failure_reasons()["dec"]
        assert "engine 's2' runs TP 2 and this engine TP 1: recurrent state" in reason, reason
        assert torch.all(c.caches[(0, 0)]["model.layers.0.self_attn"] == 7)


def _multi(children: list[dict]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        engine_id="multi",
        kv_connector_extra_config={"connectors": children},
    )


def test_a_multi_connector_follows_groups_only_when_every_child_does(tmp_path):
    ucx = {"kv_connector": "UcxConnector"}
    storage = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    hybrid_layout = KVCacheLayout(
        model="m", dtype="float32", block_size=8, num_blocks=4, num_layers=4, num_kv_heads=2,
        head_dim=4, groups=hybrid(), null_block_id=0,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"MultiConnector child 1:SharedStorageConnector follows one"
    ):
        MultiConnector(_multi([ucx, storage]), KVConnectorRole.SCHEDULER, hybrid_layout)
    both = MultiConnector(_multi([ucx]), KVConnectorRole.SCHEDULER, hybrid_layout)
    try:
        assert supports_hma(both)
    finally:
        both.shutdown()
    dense = MultiConnector(_multi([ucx, storage]), KVConnectorRole.SCHEDULER, None)
    try:
        assert not supports_hma(dense)  # a one-group engine runs it, through request_finished
    finally:
        dense.shutdown()


# DeepSeek-V4's shape: groups of whole pages (the same on every TP rank), one of its own block
# size. Layers 1 and 3: full attention over the engine's 8-token blocks; 0 and 2: a window of
# 8 tokens over 4-token blocks, so 44 tokens span 11 of its blocks and cdiv(8, 4) + 1 = 3 move.
def whole_pages() -> tuple[KVCacheGroup, ...]:
    return (
        KVCacheGroup(FULL_ATTENTION, FULL, whole_pages=True),
        KVCacheGroup(SLIDING_WINDOW, WINDOWED, 8, block_size=4, whole_pages=True),
    )


PAGES_PRODUCER = ((3, 4, 5, 6, 7, 8), (0,) * 8 + (9, 10, 11))
PAGES_CONSUMER = ((13, 14, 15, 16, 17, 18), (0,) * 8 + (19, 20, 21))


@pytest.mark.parametrize(("tp_p", "tp_c", "plane"), [(2, 1, "rma"), (1, 2, "tagged")])
def test_whole_pages_of_own_block_sizes_move_from_one_rank_each(tp_p, tp_c, plane):
    with engines(
        dict(engine_id="vp", tp=tp_p, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=whole_pages(), data_plane=plane),
        dict(engine_id="vc", tp=tp_c, pp=1, role="kv_consumer", draft=False,
             groups=whole_pages(), data_plane=plane),
    ) as (p, c):  # fmt: skip
        params = _producer_params(p, PAGES_PRODUCER)
        assert params["remote_block_ids"] == [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
        spec = _consumer_load(c, params, blocks=PAGES_CONSUMER)
        assert runs(spec) == [
            (0, PAGES_PRODUCER[0], PAGES_CONSUMER[0], 0),
            (1, (9, 10, 11), (19, 20, 21), 6),
        ]  # fmt: skip
        done = {rank: ({"dec"}, set(), set()) for rank in c.workers}
        assert run_load(c, spec) == done
        for rank, caches in c.caches.items():
            stats = c.workers[rank].get_kv_connector_stats().data
            assert stats["bytes_received_sliding_window"] == 3 * len(WINDOWED) * 2 * STATE_WIDTH
            for names, pairs in (
                (FULL, list(zip(PRODUCER_BLOCKS[0], CONSUMER_BLOCKS[0], strict=True))),
                (WINDOWED, [(9, 19), (10, 20), (11, 21)]),
            ):
                for name in names:
                    expected = sentinel_cache(caches[name].shape, "fp8")
                    for remote, local in pairs:
                        expected[local] = state_pages(SEED, name)[remote]
                    assert torch.equal(caches[name], expected), (rank, name)


def test_groups_of_other_block_sizes_fail_the_load_naming_both():
    other = (whole_pages()[0], KVCacheGroup(SLIDING_WINDOW, WINDOWED, 8, whole_pages=True))
    with engines(
        dict(engine_id="bs4", tp=1, pp=1, role="kv_producer", seed=SEED, draft=False,
             groups=whole_pages()),
        dict(engine_id="bs8", tp=1, pp=1, role="kv_consumer", draft=False, groups=other),
    ) as (p, c):  # fmt: skip
        params = _producer_params(p, PAGES_PRODUCER)
        blocks = (PAGES_CONSUMER[0], (0, 0, 0, 19, 20, 21))
        half = c.scheduler
        req = request("dec", PROMPT_TOKENS, params)
        count, _ = half.get_num_new_matched_tokens(req, 0)
        half.update_state_after_alloc(req, blocks, count)
        (spec,) = half.build_connector_meta(SimpleNamespace()).loads
        assert run_load(c, spec)[(0, 0)][1] == {"dec"}
        reason = c.workers[(0, 0)].get_load_failure_reasons()["dec"]
        assert (
            "layer 'model.layers.0.self_attn' is sliding_window:8/4 on engine 'bs4'" in reason
            and "sliding_window:8 on this engine" in reason
        ), reason
        assert torch.all(c.caches[(0, 0)]["model.layers.1.self_attn"] == 7)
