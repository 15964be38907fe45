"""Recurrent state between engines of different TP sizes, in vLLM's page layout, over real UCX.

vLLM keeps a Mamba2 or Gated DeltaNet layer's state as one opaque page per block, its conv
channels (x|B|C or q|k|v) and SSM heads split across TP ranks. The adapter describes each
sub-projection as a `StatePart`; a consumer rank then reads each part's heads from the producer
ranks holding them. Pages are built per rank from one seeded global state (`StateModel`), so
the bytes a TP 1 decode must end up with after a TP 2 prefill (and back) are known
independently: every part in place, the page padding and every other block untouched.
"""

from __future__ import annotations

import pytest
import torch
from test_ucx_connector_groups import FULL, _consumer_load, _producer_params
from ucx_helpers.state_model import StateModel
from ucx_helpers.synthetic import SENTINEL, engines, global_layer, run_load

from kvtransfer.connector.kv_groups import FULL_ATTENTION, KVCacheGroup

pytestmark = pytest.mark.integration

SEED = 23
STATE = ("model.layers.0.self_attn", "model.layers.2.self_attn")
PRODUCER = ((9,), (3, 4, 5, 6, 7, 8))
CONSUMER = ((19,), (13, 14, 15, 16, 17, 18))

MODELS = {
    # One B/C group: vLLM replicates it on both ranks of TP 2.
    "mamba2-1group-SD": StateModel("mamba2", dim_first=False, groups=1),
    "mamba2-2groups-DS": StateModel("mamba2", dim_first=True, groups=2),
    "gdn-SD": StateModel("gdn", dim_first=False, heads=4, head_dim=2, groups=2, state=4),
    "gdn-DS": StateModel("gdn", dim_first=True, heads=4, head_dim=2, groups=2, state=4),
}


def groups(model: StateModel, tp: int) -> tuple[KVCacheGroup, ...]:
    return (model.group(STATE, tp), KVCacheGroup(FULL_ATTENTION, FULL))


def side(engine_id: str, role: str, model: StateModel, tp: int, plane: str, **extra) -> dict:
    return dict(
        engine_id=engine_id, tp=tp, pp=1, role=role, draft=False, groups=groups(model, tp),
        data_plane=plane, state_maker=model.rank_pages, **extra,
    )  # fmt: skip


# Equal TP sizes in parts once: the replicated group read from the same rank's replica.
PAIRINGS = [
    (family, producer, consumer) for family in MODELS for producer, consumer in ((2, 1), (1, 2))
] + [("mamba2-1group-SD", 2, 2)]


@pytest.mark.parametrize("plane", ["rma", "tagged"])
@pytest.mark.parametrize(("family", "producer_tp", "consumer_tp"), PAIRINGS)
def test_state_moves_between_tp_sizes_part_by_part(family, producer_tp, consumer_tp, plane):
    model = MODELS[family]
    tag = f"{family}-{producer_tp}{consumer_tp}-{plane}"
    with engines(
        side(f"p-{tag}", "kv_producer", model, producer_tp, plane, seed=SEED),
        side(f"c-{tag}", "kv_consumer", model, consumer_tp, plane),
    ) as (p, c):
        spec = _consumer_load(c, _producer_params(p, PRODUCER), blocks=CONSUMER)
        results = run_load(c, spec)
        assert all(done == {"dec"} and not failed for done, failed, _ in results.values())
        for (_, rank), caches in c.caches.items():
            for name in STATE:
                expected = model.expected_pages(SEED, name, consumer_tp, rank, [(9, 19)])
                assert torch.equal(caches[name], expected), (name, rank)
            for name in FULL:
                source = global_layer(SEED, name)
                heads = slice(rank, rank + 1) if consumer_tp == 2 else slice(0, 2)
                expected = torch.full_like(source[:, :, heads], SENTINEL)
                for remote, local in zip(PRODUCER[1], CONSUMER[1], strict=True):
                    expected[local] = source[remote, :, heads]
                assert torch.equal(caches[name], expected), (name, rank)
        # Each consumer rank received its share of every part once: no replica read twice.
        received = sum(
            w.get_kv_connector_stats().data["bytes_received_recurrent_state"]
            for w in c.workers.values()
        )
        content = model.page_bytes(consumer_tp) - model.pad
        assert received == len(STATE) * consumer_tp * content


def test_conv_layouts_that_differ_fail_the_load_naming_both():
    sd, ds = MODELS["gdn-SD"], MODELS["gdn-DS"]
    with engines(
        side("lp", "kv_producer", sd, 2, "rma", seed=SEED),
        side("lc", "kv_consumer", ds, 1, "rma"),
    ) as (p, c):
        spec = _consumer_load(c, _producer_params(p, PRODUCER), blocks=CONSUMER)
        assert run_load(c, spec)[(0, 0)][1] == {"dec"}
        reason = c.workers[(0, 0)].get_load_failure_reasons()["dec"]
        assert "layer 'model.layers.0.self_attn' keeps its state in parts" in reason, reason
        assert "on engine 'lp'" in reason and "their state layouts differ" in reason, reason
        untouched = ds.rank_pages(STATE[0], 1, 0, None)
        assert torch.equal(c.caches[(0, 0)][STATE[0]], untouched)


def test_group_counts_that_differ_fail_the_load_naming_both():
    one, two = MODELS["mamba2-1group-SD"], StateModel("mamba2", dim_first=False, groups=2)
    with engines(
        side("gp", "kv_producer", one, 2, "tagged", seed=SEED),
        side("gc", "kv_consumer", two, 2, "tagged"),
    ) as (p, c):
        spec = _consumer_load(c, _producer_params(p, PRODUCER), blocks=CONSUMER)
        failed = {rank for rank, (_, f, _) in run_load(c, spec).items() if f == {"dec"}}
        assert failed == {(0, 0), (0, 1)}
        reason = c.workers[(0, 0)].get_load_failure_reasons()["dec"]
        assert "conv.B: 1 x 16 B x 3" in reason and "conv.B: 2 x 16 B x 3" in reason, reason
