"""Speculative decoding: same tokens as plain decoding, drafter KV saved before post_forward,
and the worker's mirror of computed tokens never drifts from the scheduler's."""

from __future__ import annotations

import json

import pytest

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

# Repetitive prompts give the n-gram proposer something to find.
PROMPTS = [
    [10, 11, 12, 13] * 6,
    [(3 * i) % 97 + 5 for i in range(30)],
    list(range(60, 69)),
]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_k=40, seed=1234)


def generate(params: SamplingParams, speculative: SpeculativeConfig | None = None, **kw):
    config = EngineConfig(model="builtin", block_size=8, speculative=speculative, **kw)
    with LLM(config) as llm:
        outputs = llm.generate(PROMPTS, params)
        llm.engine.drain()
        llm.engine.check_no_leaks()
        return outputs


@pytest.fixture(scope="module")
def plain_greedy():
    return [o.token_ids for o in generate(GREEDY)]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_speculative_equals_plain(method, plain_greedy):
    outputs = generate(GREEDY, SpeculativeConfig(method=method, num_speculative_tokens=3))
    assert [o.token_ids for o in outputs] == plain_greedy
    drafted = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_tokens for o in outputs)
    # Both proposers must have proposed, and had some but not all proposals accepted, so
    # the acceptance and the rollback paths both ran.
    assert drafted > 0
    assert 0 < accepted < drafted
    for output in outputs:
        assert 0.0 <= output.acceptance_rate <= 1.0


def test_seeded_sampling_is_identical_with_and_without_drafts():
    plain = [o.token_ids for o in generate(SEEDED)]
    speculative = generate(SEEDED, SpeculativeConfig(method="draft", num_speculative_tokens=2))
    assert [o.token_ids for o in speculative] == plain


def test_draft_model_under_tensor_parallel_equals_plain(plain_greedy):
    outputs = generate(
        GREEDY, SpeculativeConfig(method="draft", num_speculative_tokens=3), tensor_parallel_size=2
    )
    assert [o.token_ids for o in outputs] == plain_greedy


@pytest.mark.parametrize("deferred", [False, True], ids=["vllm-0.32-order", "vllm-0.33-deferred"])
def test_drafter_kv_is_registered_and_saved_before_the_step_is_finalized(tmp_path, deferred):
    kv_config = KVTransferConfig(
        kv_connector="RecordingConnector",
        kv_connector_module_path="kvtransfer.testing.recording",
        kv_role="kv_both",
        kv_connector_extra_config={"record_dir": str(tmp_path)},
    )
    generate(
        GREEDY,
        SpeculativeConfig(method="draft", num_speculative_tokens=3, defer_kv_finalize=deferred),
        kv_transfer_config=kv_config,
    )
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert sorted(r["role"] for r in records) == ["SCHEDULER", "WORKER"]
    (worker,) = [r["calls"] for r in records if r["role"] == "WORKER"]
    registered = next(detail for hook, detail in worker if hook == "register_kv_caches")
    assert [n for n in registered if n.startswith("draft.layers.")] == [
        "draft.layers.0.self_attn",
        "draft.layers.1.self_attn",
    ]
    assert len([n for n in registered if n.startswith("model.layers.")]) == 4

    # Split the worker's calls into steps at each bind; in every step with a forward, all
    # saves (target and drafter) come before wait_for_save, and the metadata is cleared last.
    # vLLM 0.32's order: get_finished after wait_for_save. 0.33's deferred one: get_finished
    # right after the target's saves, before the drafter's saves and wait_for_save.
    steps, current = [], []
    for hook, detail in worker:
        if hook == "bind_connector_metadata" and current:
            steps.append(current)
            current = []
        current.append((hook, detail))
    steps.append(current)
    forward_steps = [s for s in steps if any(h == "wait_for_save" for h, _ in s)]
    assert forward_steps
    drafter_saved_steps = 0
    for step in forward_steps:
        hooks = [h for h, _ in step]
        wait, collected = hooks.index("wait_for_save"), hooks.index("get_finished")
        saves = [i for i, (h, _) in enumerate(step) if h == "save_kv_layer"]
        drafter = [i for i in saves if str(step[i][1]).startswith("draft.layers.")]
        target = [i for i in saves if i not in drafter]
        assert saves and max(saves) < wait
        if deferred:
            assert max(target) < collected < min(drafter)
        else:
            assert wait < collected
        assert hooks[-1] == "clear_connector_metadata"
        if any(str(d).startswith("draft.layers.") for h, d in step if h == "save_kv_layer"):
            drafter_saved_steps += 1
    assert drafter_saved_steps == len(forward_steps)


def test_worker_mirror_follows_scheduler_after_rejections():
    config = EngineConfig(
        model="builtin",
        block_size=8,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    with LLM(config) as llm:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        worker = engine.executor._worker
        rejected_steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.num_draft_tokens > output.num_accepted_tokens:
                    rejected_steps += 1
            for req_id in worker.runner.requests.req_ids():
                request = engine.scheduler.get_request(req_id)
                if request is None or request.status.is_finished:
                    continue
                # Decoding requests have every token but the newest computed; the worker learns
                # the value at its next step and must not have counted on its own meanwhile.
                assert request.num_computed_tokens == request.num_tokens - 1
        assert rejected_steps > 0
        engine.drain()
        engine.check_no_leaks()
