"""`UcxConnector` between engines split differently, every worker its own process (real
gRPC, real UCX between processes): each consumer worker pulls exactly its layers and KV heads
from the producer workers holding them, and the consumer's greedy tokens equal a colocated
run's, for several concurrent requests and a prefix-cache hit on the consumer; speculative
decoding keeps the colocated acceptance. Larger pairings run in the slow tier."""

from __future__ import annotations

import pytest
from engine_helpers.builtin import DRAFT, PROMPTS, colocated, engine_config
from ucx_helpers.engines import kv_config, pd_run, scheduler_half

from kvtransfer.engine.llm import LLM

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in colocated(PROMPTS)]


def _engine(role: str, engine_id: str, tp: int, pp: int, **overrides) -> LLM:
    config = engine_config(
        kv_config(role, engine_id), tensor_parallel_size=tp, pipeline_parallel_size=pp, **overrides
    )
    return LLM(config)


def _check_pairing(producer_split, consumer_split, expected) -> None:
    with (
        _engine("kv_producer", "prefill", *producer_split) as producer,
        _engine("kv_consumer", "decode", *consumer_split) as consumer,
    ):
        results = pd_run(producer, consumer, PROMPTS)
        assert [r.token_ids for r in results] == expected
        # The same prompt again: the consumer's prefix cache holds its first four blocks.
        again = pd_run(producer, consumer, [PROMPTS[2]])
        assert again[0].token_ids == expected[2]
        assert consumer.engine.scheduler.stats.num_prefix_cache_hit_tokens == 32
        received = scheduler_half(consumer.engine).stats_totals
        sent = scheduler_half(producer.engine).stats_totals
    consumer_workers = consumer_split[0] * consumer_split[1]
    num_blocks = sum(-(-len(p) // 8) for p in PROMPTS) + 1
    # Every consumer worker handshook once and loaded every request's missing blocks.
    assert received["num_handshakes"] == consumer_workers
    assert received["num_loads"] == (len(PROMPTS) + 1) * consumer_workers
    assert received["blocks_received"] == num_blocks * consumer_workers
    assert sent["num_sends"] == (len(PROMPTS) + 1) * producer_split[0] * producer_split[1]
    assert "num_leases_expired" not in sent


def test_tp2_pp2_producer_to_pp2_consumer(expected):
    _check_pairing((2, 2), (1, 2), expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("producer_split", "consumer_split"),
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((1, 1), (1, 2))],
    ids=["tp2-to-1", "1-to-tp2", "pp2-to-1", "1-to-pp2"],
)
def test_pairings(producer_split, consumer_split, expected):
    _check_pairing(producer_split, consumer_split, expected)


@pytest.mark.slow
def test_draft_model_across_pp2_to_tp2_keeps_the_colocated_acceptance():
    prompts = PROMPTS[1:]
    reference = colocated(prompts, speculative=DRAFT)
    with (
        _engine("kv_producer", "prefill", 1, 2, speculative=DRAFT) as producer,
        _engine("kv_consumer", "decode", 2, 1, speculative=DRAFT) as consumer,
    ):
        results = pd_run(producer, consumer, prompts)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert sum(r.num_draft_tokens for r in results) > 0
    assert [(r.num_draft_tokens, r.num_accepted_tokens) for r in results] == [
        (r.num_draft_tokens, r.num_accepted_tokens) for r in reference
    ]
