"""Hybrid models in a whole engine (worker processes): every TP/PP split and chunking gives the
same tokens with every block freed; a connector that follows one KV cache group is refused when
the engine starts, naming the connector and what it lacks, and leaves no worker behind; so is
speculative decoding for a recurrent state."""

from __future__ import annotations

import os

import pytest
from serve_helpers.pair import descendants
from waiting import wait_until

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


def test_a_one_group_connector_is_refused_for_a_hybrid_model(tmp_path):
    before = set(descendants(os.getpid()))
    storage = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    config = EngineConfig(
        model="builtin:tiny-hybrid", block_size=4, num_kv_blocks=64, kv_transfer_config=storage
    )
    with pytest.raises(ValueError) as info:
        EngineCore(config)
    assert str(info.value) == (
        "KV connector SharedStorageConnector does not support hybrid KV caches (SupportsHMA), "
        "and this model has a sliding-window group (window 24) beside full attention; use one "
        "that does, such as UcxConnector"
    )
    wait_until(lambda: set(descendants(os.getpid())) <= before, "the engine's workers exited", 30)


@pytest.mark.parametrize("model", ["builtin:tiny-hybrid", "builtin:tiny-mamba"])
def test_every_split_and_chunking_gives_the_same_tokens_and_frees_every_block(model):
    """TP 2, PP 2, chunked prefill and one sequence at a time (preemption-free queueing) give
    the tokens of one process, and every block (every group's) is free afterwards."""
    prompts = [list(range(40, 40 + n)) for n in (5, 30, 77)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for split in (
        {},
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"max_num_batched_tokens": 16},
        {"max_num_seqs": 1},
    ):
        config = EngineConfig(model=model, block_size=4, num_kv_blocks=96, **split)
        with LLM(config) as llm:
            runs[str(split)] = [o.token_ids for o in llm.generate(prompts, params)]
            llm.engine.scheduler.block_manager.check_no_leaks()
    assert all(tokens == runs["{}"] for tokens in runs.values()), runs


def test_speculative_decoding_is_refused_for_a_recurrent_state():
    config = EngineConfig(model="builtin:tiny-mamba", speculative=SpeculativeConfig(method="ngram"))
    with pytest.raises(ValueError) as info:
        EngineCore(config)
    assert str(info.value) == (
        "speculative decoding is not supported for a model with Mamba layers: a recurrent "
        "state cannot be rewound past rejected draft tokens"
    )


def test_a_sliding_window_prefix_hit_gives_the_tokens_of_no_cache():
    """Prompts sharing a 60-token prefix, one after another: the later ones hit the prefix
    cache in both groups and still give the tokens of an engine without prefix caching."""
    prefix = list(range(40, 100))
    prompts = [[*prefix, 7, 8, 9], [*prefix, 100, 101], [*prefix[:50], 3]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        config = EngineConfig(
            model="builtin:tiny-hybrid",
            block_size=4,
            num_kv_blocks=96,
            enable_prefix_caching=caching,
        )
        with LLM(config) as llm:
            outputs = [llm.generate([prompt], params)[0] for prompt in prompts]
            runs[caching] = [o.token_ids for o in outputs]
            cached = llm.engine.scheduler.stats.num_prefix_cache_hit_tokens
            llm.engine.scheduler.block_manager.check_no_leaks()
        if caching:
            # The second prompt hits the 15 full blocks of the shared prefix in both groups
            # (60 tokens), the third 12 (48 of its 51: its last token is computed).
            assert cached == 60 + 48, cached
    assert runs[True] == runs[False]
