"""Prefill on a producer engine, decode on a consumer engine, through `SharedStorageConnector`:
the consumer's greedy tokens equal a colocated run's, its loaded KV equals the producer's
bytes, and failures follow ``kv_load_failure_policy`` without leaking a block."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from engine_helpers.builtin import (
    BLOCK_SIZE,
    DECODE,
    DRAFT,
    PREFILL,
    PROMPTS,
    colocated_tokens,
    engine_config,
    worker_caches,
)
from shared_storage_helpers.engines import decode, kv_config, prefill, read_file
from waiting import step_until

from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.scheduler.request import RequestStatus

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def expected():
    return colocated_tokens(PROMPTS)


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    """Every prompt prefilled once by a producer; (storage root, outputs)."""
    root = tmp_path_factory.mktemp("kv")
    with LLM(engine_config(kv_config(root, "kv_producer", "prefill"))) as llm:
        return root, prefill(llm, PROMPTS)


def consumer(root, policy="fail", engine_id="decode", **extra) -> LLM:
    return LLM(engine_config(kv_config(root, "kv_consumer", engine_id, policy, **extra)))


def test_producer_returns_params_and_frees_blocks_once_saved(tmp_path, expected):
    prompts = [*PROMPTS, [1, 2, 3]]
    params = [{"do_remote_decode": True}] * len(PROMPTS) + [None]
    with LLM(engine_config(kv_config(tmp_path, "kv_producer", "prefill"))) as llm:
        outputs = llm.generate(prompts, PREFILL, params)
        # The prompts' blocks outlive their requests until the save is reported.
        blocks = sum(-(-len(p) // BLOCK_SIZE) for p in PROMPTS)
        assert llm.engine.scheduler.block_manager.num_used_blocks == blocks
        assert llm.engine.has_pending_work()
        llm.engine.drain()
        llm.engine.check_no_leaks()
    for i, (prompt, output) in enumerate(zip(PROMPTS, outputs, strict=False)):
        assert output.token_ids == expected[i][:1]
        assert output.kv_transfer_params == {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_request_id": f"gen-{i}",
            "remote_num_tokens": len(prompt),
            "tp_size": 1,
            "pp_size": 1,
        }
        metadata, tensors = read_file(tmp_path / "prefill" / f"gen-{i}" / "pp0_tp0.safetensors")
        assert metadata["num_tokens"] == str(len(prompt))
        assert tensors["__token_ids__"].tolist() == prompt
        assert tensors["model.layers.3.self_attn"].shape[0] == -(-len(prompt) // BLOCK_SIZE)
    assert outputs[-1].kv_transfer_params is None
    assert sorted(p.name for p in (tmp_path / "prefill").iterdir()) == [
        f"gen-{i}" for i in range(len(PROMPTS))
    ]


def test_concurrent_requests_decode_like_colocated(produced, expected):
    root, outputs = produced
    with consumer(root) as llm:
        results = decode(llm, PROMPTS, [o.kv_transfer_params for o in outputs])
        assert llm.engine.scheduler.stats.num_prefix_cache_hit_tokens == 0
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)


def test_consumer_prefix_hit_loads_only_the_rest(produced, expected, monkeypatch):
    root, outputs = produced
    with consumer(root) as llm:
        loads = []
        build = llm.engine.connector.build_connector_meta

        def spy(scheduler_output):
            metadata = build(scheduler_output)
            loads.extend(metadata.loads)
            return metadata

        monkeypatch.setattr(llm.engine.connector, "build_connector_meta", spy)
        params = outputs[2].kv_transfer_params
        first = decode(llm, [PROMPTS[2]], [params])
        again = decode(llm, [PROMPTS[2]], [params])
        assert llm.engine.scheduler.stats.num_prefix_cache_hit_tokens == 32
    assert first[0].token_ids == again[0].token_ids == expected[2]
    # 40 tokens: the second request finds blocks 0-3 cached and loads only block 4.
    assert [(load.start_token, load.end_token) for load in loads] == [(0, 40), (32, 40)]


def test_loaded_blocks_equal_the_producers_bytes(tmp_path):
    prompt = PROMPTS[3]
    producer = EngineCore(engine_config(kv_config(tmp_path, "kv_producer", "prefill")))
    producer.add_request("p", prompt, PREFILL, {"do_remote_decode": True})
    params = None
    while params is None:
        params = next((o.kv_transfer_params for o in producer.step() if o.finished), None)
    producer_blocks = producer.scheduler.block_manager.get_block_ids("p")
    producer.drain()
    producer.check_no_leaks()
    _, saved = read_file(tmp_path / "prefill" / "p" / "pp0_tp0.safetensors")
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    for name, cache in worker_caches(producer).items():
        assert torch.equal(saved[name], cache[producer_blocks[:num_blocks]]), name
    producer.shutdown()

    decoder = EngineCore(engine_config(kv_config(tmp_path, "kv_consumer", "decode")))
    decoder.add_request("d", prompt, DECODE, params)
    request = decoder.scheduler.get_request("d")
    decoder.step()
    step_until(
        decoder.step,
        lambda: request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS,
        "the load ended",
    )
    # Loaded, not yet run: only a load gets there, and the next step recomputes the last token.
    assert request.status is RequestStatus.WAITING_WITH_KV
    assert request.num_computed_tokens == len(prompt) - 1
    consumer_blocks = decoder.scheduler.block_manager.get_block_ids("d")[:num_blocks]
    for name, cache in worker_caches(decoder).items():
        assert torch.equal(cache[consumer_blocks], saved[name]), name
    decoder.drain()
    decoder.check_no_leaks()
    decoder.shutdown()


@pytest.mark.parametrize("deferred", [False, True], ids=["vllm-0.32-order", "vllm-0.33-deferred"])
def test_draft_model_layers_travel_and_decode_like_colocated(tmp_path, deferred):
    # In both step orders the drafter's KV must be saved whole before the save is reported
    # done: the consumer reads every drafter layer byte for byte and decodes like colocated.
    prompts = PROMPTS[1:3]
    expected = colocated_tokens(prompts, speculative=DRAFT)
    assert expected == colocated_tokens(prompts)
    spec = replace(DRAFT, defer_kv_finalize=deferred)
    producer_config = engine_config(kv_config(tmp_path, "kv_producer", "p"), speculative=spec)
    with LLM(producer_config) as llm:
        outputs = prefill(llm, prompts)
    _, saved = read_file(tmp_path / "p" / "gen-1" / "pp0_tp0.safetensors")
    assert sorted(saved) == [
        "__token_ids__",
        "draft.layers.0.self_attn",
        "draft.layers.1.self_attn",
        *(f"model.layers.{i}.self_attn" for i in range(4)),
    ]
    assert saved["draft.layers.1.self_attn"].abs().sum() > 0

    decoder = EngineCore(engine_config(kv_config(tmp_path, "kv_consumer", "d"), speculative=spec))
    decoder.add_request("d", prompts[1], DECODE, outputs[1].kv_transfer_params)
    request = decoder.scheduler.get_request("d")
    step_until(
        decoder.step, lambda: request.status is RequestStatus.WAITING_WITH_KV, "the load finished"
    )
    blocks = decoder.scheduler.block_manager.get_block_ids("d")[: -(-len(prompts[1]) // BLOCK_SIZE)]
    caches = worker_caches(decoder)
    assert {"draft.layers.0.self_attn", "draft.layers.1.self_attn"} <= set(caches)
    for name, cache in caches.items():
        assert torch.equal(cache[blocks], saved[name]), name
    decoder.drain()
    decoder.check_no_leaks()
    decoder.shutdown()

    with LLM(engine_config(kv_config(tmp_path, "kv_consumer", "d2"), speculative=spec)) as llm:
        results = decode(llm, prompts, [o.kv_transfer_params for o in outputs])
    assert [r.token_ids for r in results] == expected
    assert sum(r.num_draft_tokens for r in results) > 0


def _break(root, case, outputs):
    """Producer params made to fail in the given way; returns (prompt index, params)."""
    params = dict(outputs[1].kv_transfer_params)
    if case == "missing":
        params["remote_request_id"] = "never-produced"
    elif case == "corrupt":
        broken = root / "prefill" / "corrupt"
        broken.mkdir(exist_ok=True)
        (broken / "pp0_tp0.safetensors").write_bytes(b"\0" * 64)
        params["remote_request_id"] = "corrupt"
    else:  # the consumer's prompt is not the one the producer saved
        return 0, {**params, "remote_num_tokens": len(PROMPTS[0])}
    return 1, params


@pytest.mark.parametrize("case", ["missing", "corrupt", "other-prompt"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_follows_the_policy(produced, expected, case, policy):
    root, outputs = produced
    index, params = _break(root, case, outputs)
    with consumer(root, policy, engine_id=f"decode-{policy}", load_timeout_s=0.2) as llm:
        results = llm.generate([PROMPTS[index], PROMPTS[2]], DECODE, [params, None])
        llm.engine.drain()
        llm.engine.check_no_leaks()
    failed, plain = results
    assert plain.token_ids == expected[2]
    if policy == "fail":
        assert failed.finish_reason == "error"
        reason = {
            "missing": "LoadError: producer file(s) pp0_tp0.safetensors did not appear",
            "corrupt": "StorageFormatError: cannot read pp0_tp0.safetensors",
            "other-prompt": "",
        }[case]
        assert failed.error.startswith(
            f"KV load failed for request gen-0 (kv_load_failure_policy=fail): {reason}"
        )
        assert failed.token_ids == []
    else:
        assert failed.token_ids == expected[index]
        assert failed.finish_reason == "length"


def test_block_size_mismatch_fails_the_load(produced):
    root, outputs = produced
    config = engine_config(kv_config(root, "kv_consumer", "decode-16"), block_size=16)
    with LLM(config) as llm:
        (result,) = llm.generate([PROMPTS[3]], DECODE, [outputs[3].kv_transfer_params])
        llm.engine.drain()
        llm.engine.check_no_leaks()
    assert result.error.startswith(
        "KV load failed for request gen-0 (kv_load_failure_policy=fail): "
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_request_id": None}, "kv_transfer_params.remote_request_id is missing"),
        ({"remote_num_tokens": "40"}, "kv_transfer_params.remote_num_tokens must be an int >= 0"),
        ({"do_remote_prefill": "true"}, "kv_transfer_params.do_remote_prefill must be a bool"),
    ],
)
def test_malformed_params_are_rejected_before_anything_is_held(produced, expected, change, message):
    root, outputs = produced
    params = {**outputs[2].kv_transfer_params, **change}
    params = {k: v for k, v in params.items() if v is not None}
    with consumer(root) as llm:
        with pytest.raises(ValueError, match=re.escape(f"request 'bad': {message}")):
            llm.engine.add_request("bad", PROMPTS[2], DECODE, params)
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
        (good,) = decode(llm, [PROMPTS[3]], [outputs[3].kv_transfer_params])
        after = decode(llm, [PROMPTS[1]], [outputs[1].kv_transfer_params])
    assert good.token_ids == expected[3]
    assert after[0].token_ids == expected[1]


def test_abort_during_load_keeps_blocks_until_the_load_reports(tmp_path):
    core = EngineCore(engine_config(kv_config(tmp_path, "kv_consumer", "d", load_timeout_s=60)))
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill",
        "remote_request_id": "not-yet",
        "remote_num_tokens": 40,
        "tp_size": 1,
        "pp_size": 1,
    }
    core.add_request("d", PROMPTS[2], DECODE, params)
    core.step()
    assert core.scheduler.get_request("d").status is RequestStatus.WAITING_FOR_REMOTE_KVS
    used = core.scheduler.block_manager.num_used_blocks
    assert used == 5
    (aborted,) = core.abort_request(["d"])
    assert aborted.finish_reason == "abort"
    assert core.scheduler.block_manager.num_used_blocks == used
    # This step tells the worker the request finished; its load is cancelled and reports later.
    core.step()
    assert core.scheduler.block_manager.num_used_blocks == used
    assert core.has_pending_work()
    core.drain()
    core.check_no_leaks()
    core.shutdown()


def test_delete_after_load_removes_consumed_files(tmp_path, expected):
    with LLM(engine_config(kv_config(tmp_path, "kv_producer", "prefill"))) as llm:
        outputs = prefill(llm, PROMPTS[:2])
    assert sorted(p.name for p in (tmp_path / "prefill").iterdir()) == ["gen-0", "gen-1"]
    with consumer(tmp_path, delete_after_load=True) as llm:
        results = decode(llm, PROMPTS[:1], [outputs[0].kv_transfer_params])
    assert results[0].token_ids == expected[0]
    assert sorted(p.name for p in (tmp_path / "prefill").iterdir()) == ["gen-1"]


def test_kv_both_engine_serves_its_own_prefills(tmp_path, expected):
    with LLM(engine_config(kv_config(tmp_path, "kv_both", "both"))) as llm:
        outputs = prefill(llm, PROMPTS)
        results = decode(llm, PROMPTS, [o.kv_transfer_params for o in outputs])
    assert [r.token_ids for r in results] == expected
