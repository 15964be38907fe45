"""`SharedStorageConnector` between engines split differently (TP2 -> TP1, PP2 -> TP1,
TP1 -> TP2): each producer worker writes its own heads and layers, each consumer worker reads
the ones it holds, and the consumer's greedy tokens equal a colocated run's."""

from __future__ import annotations

import json

import pytest
from engine_helpers.builtin import PREFILL, PROMPTS, colocated_tokens, engine_config
from shared_storage_helpers.engines import decode, kv_config, prefill, read_file
from waiting import step_until

from kvtransfer.engine.llm import LLM

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def expected():
    return colocated_tokens(PROMPTS)


def layers_of(path) -> dict[str, list[int]]:
    metadata, _ = read_file(path)
    return json.loads(metadata["layers"])


def test_tp2_producer_frees_blocks_only_after_both_workers_saved(tmp_path, expected):
    config = engine_config(kv_config(tmp_path, "kv_producer", "p"), tensor_parallel_size=2)
    with LLM(config) as llm:
        outputs = llm.generate(PROMPTS, PREFILL, [{"do_remote_decode": True}] * len(PROMPTS))
        directories = [tmp_path / "p" / f"gen-{i}" for i in range(len(PROMPTS))]
        core = llm.engine
        assert core.scheduler.block_manager.num_used_blocks > 0
        step_until(
            core.step,
            lambda: not core.scheduler.block_manager.num_used_blocks,
            "both workers' saves reported (blocks freed)",
        )
        # Blocks are free: every worker of the engine has written its file.
        for directory in directories:
            assert sorted(p.name for p in directory.iterdir()) == [
                "pp0_tp0.safetensors",
                "pp0_tp1.safetensors",
            ]
        core.drain()
        core.check_no_leaks()
    assert [o.kv_transfer_params["tp_size"] for o in outputs] == [2] * len(PROMPTS)
    assert layers_of(directories[0] / "pp0_tp1.safetensors") == {
        f"model.layers.{i}.self_attn": [1, 2, 2] for i in range(4)
    }
    with LLM(engine_config(kv_config(tmp_path, "kv_consumer", "d"))) as llm:
        results = decode(llm, PROMPTS, [o.kv_transfer_params for o in outputs])
    assert [r.token_ids for r in results] == expected


def test_pp2_producer_to_single_worker_consumer(tmp_path, expected):
    config = engine_config(kv_config(tmp_path, "kv_producer", "p"), pipeline_parallel_size=2)
    with LLM(config) as llm:
        outputs = prefill(llm, PROMPTS)
    assert [o.kv_transfer_params["pp_size"] for o in outputs] == [2] * len(PROMPTS)
    directory = tmp_path / "p" / "gen-3"
    assert sorted(layers_of(directory / "pp0_tp0.safetensors")) == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert sorted(layers_of(directory / "pp1_tp0.safetensors")) == [
        "model.layers.2.self_attn",
        "model.layers.3.self_attn",
    ]
    with LLM(engine_config(kv_config(tmp_path, "kv_consumer", "d"))) as llm:
        results = decode(llm, PROMPTS, [o.kv_transfer_params for o in outputs])
    assert [r.token_ids for r in results] == expected


def test_single_worker_producer_to_tp2_consumer(tmp_path, expected):
    with LLM(engine_config(kv_config(tmp_path, "kv_producer", "p"))) as llm:
        outputs = prefill(llm, PROMPTS)
    config = engine_config(kv_config(tmp_path, "kv_consumer", "d"), tensor_parallel_size=2)
    with LLM(config) as llm:
        results = decode(llm, PROMPTS, [o.kv_transfer_params for o in outputs])
    assert [r.token_ids for r in results] == expected
