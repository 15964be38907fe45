"""The paged engine against a dense (unpaged) forward of the same weights, for TPxPP splits.

Each engine is small enough to force chunked prefill (token budget 24) and preemption (a pool
of 14 blocks of 8 for ~20 blocks of demand); a second batch re-sends a prefix for cache hits.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers.dense_reference import dense_logits

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    list(range(40, 45)),  # shorter than a block
    [(7 * i) % 200 + 3 for i in range(17)],
    [(13 * i) % 250 + 1 for i in range(40)],
    [(5 * i + 11) % 240 + 2 for i in range(70)],  # many blocks, three prefill chunks
]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)


def assert_matches_dense(prompt: list[int], output) -> None:
    config, weights = builtin_model_config("tiny"), builtin_weights("tiny")
    tokens = prompt + output.token_ids
    reference = dense_logits(config, weights, tokens[:-1])[len(prompt) - 1 :]
    assert output.token_ids == reference.argmax(dim=-1).tolist()
    assert output.logits.shape == reference.shape
    torch.testing.assert_close(output.logits, reference.float(), atol=2e-4, rtol=1e-4)


@pytest.fixture(
    scope="module", params=[(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda p: f"tp{p[0]}pp{p[1]}"
)
def llm(request):
    tp, pp = request.param
    config = EngineConfig(
        model="builtin",
        block_size=8,
        num_kv_blocks=14,
        max_num_batched_tokens=24,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    with LLM(config) as engine:
        yield engine


def test_batch_with_chunked_prefill_and_preemption_matches_dense(llm):
    before = llm.engine.scheduler.stats.num_preemptions
    outputs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.scheduler.stats.num_preemptions > before
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.finish_reason == "length"
        assert_matches_dense(prompt, output)
    llm.engine.drain()
    llm.engine.check_no_leaks()


def test_prefix_cache_hits_match_dense(llm):
    shared = PROMPTS[2]
    llm.generate([shared], PARAMS)
    hits_before = llm.engine.scheduler.stats.num_prefix_cache_hit_tokens
    extended = [*shared, 9, 8, 7]
    (output,) = llm.generate([extended], PARAMS)
    assert llm.engine.scheduler.stats.num_prefix_cache_hit_tokens - hits_before >= 32
    assert_matches_dense(extended, output)
    llm.engine.drain()
    llm.engine.check_no_leaks()
