"""Scheduler core: chunked prefill, budgets, preemption, stop conditions, aborts, prefix cache,
input validation. The workers are `ScriptedRunner` (see engine_helpers.scheduler_helpers)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers.scheduler_helpers import (
    VOCAB,
    Result,
    ScriptedRunner,
    collect,
    make_request,
    make_scheduler,
    next_token,
    prompt_of,
    reference_tokens,
    run_to_completion,
    step,
)

from kvtransfer.connector.metadata import KVRequest
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from kvtransfer.engine.scheduler.request import EngineCoreOutput, RequestStatus
from kvtransfer.engine.scheduler_output import CachedRequestData, NewRequestData

pytestmark = pytest.mark.unit


def test_chunked_prefill_splits_the_prompt_across_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = ScriptedRunner()
    prompt = prompt_of(10)
    request = make_request("a", prompt, max_tokens=3)
    sched.add_request(request)
    ref = reference_tokens(prompt, 3)

    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new == NewRequestData(
        req_id="a",
        prompt_len=10,
        token_ids=tuple(prompt),
        sampling_params=request.sampling_params,
        seed=0,
        block_ids=(0, 1),
        num_computed_tokens=0,
    )
    assert dict(so.num_scheduled_tokens) == {"a": 8}
    assert outs == []
    assert request.num_computed_tokens == 8

    so, outs = step(sched, runner)
    assert so.scheduled_cached_reqs == (
        CachedRequestData(req_id="a", new_token_ids=(), new_block_ids=(2,), num_computed_tokens=8),
    )
    assert dict(so.num_scheduled_tokens) == {"a": 2}
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(ref[0],))]

    so, outs = step(sched, runner)
    assert so.scheduled_cached_reqs == (
        CachedRequestData(
            req_id="a", new_token_ids=(ref[0],), new_block_ids=(), num_computed_tokens=10
        ),
    )
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(ref[1],))]

    so, outs = step(sched, runner)
    assert so.scheduled_cached_reqs[0].new_token_ids == (ref[1],)
    assert so.scheduled_cached_reqs[0].new_block_ids == ()
    assert outs == [
        EngineCoreOutput(req_id="a", new_token_ids=(ref[2],), finished=True, finish_reason="length")
    ]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == ref
    assert not sched.has_unfinished_requests()
    # One more (empty) step tells the workers to drop the request.
    assert sched.has_pending_work()
    so, outs = step(sched, runner)
    assert (so.total_num_scheduled_tokens, so.finished_req_ids, outs) == (0, {"a"}, [])
    assert not sched.has_pending_work() and runner.mirrors == {}
    sched.block_manager.check_no_leaks()


def test_token_budget_chunks_the_second_prompt_of_a_step():
    sched = make_scheduler(max_num_batched_tokens=12)
    runner = ScriptedRunner()
    sched.add_request(make_request("a", prompt_of(10), max_tokens=2))
    sched.add_request(make_request("b", prompt_of(10, 20), max_tokens=2))
    so, _ = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 10, "b": 2}
    # Running requests go first: a decodes (1 token), b finishes its prompt (8 tokens).
    so, _ = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 1, "b": 8}
    results = run_to_completion(sched, runner)
    assert results["b"].tokens[-1:] == reference_tokens(prompt_of(10, 20), 2)[-1:]
    sched.block_manager.check_no_leaks()


def test_max_num_seqs_limits_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    runner = ScriptedRunner()
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        sched.add_request(make_request(rid, prompt_of(5, ord(rid)), max_tokens=max_tokens))
    # What KVAdmin reports as load (a router reads it): nothing runs before the first step.
    assert (sched.num_running_requests, sched.num_waiting_requests) == (0, 3)
    so, outs = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 5, "b": 5}
    assert [o.req_id for o in outs if o.finished] == ["a"]
    assert (sched.num_running_requests, sched.num_waiting_requests) == (1, 1)
    so, _ = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"b": 1, "c": 5}
    assert so.finished_req_ids == {"a"}
    run_to_completion(sched, runner)
    assert (sched.num_running_requests, sched.num_waiting_requests) == (0, 0)
    sched.block_manager.check_no_leaks()


def _decode_pair(num_blocks: int, enable_prefix_caching: bool):
    sched = make_scheduler(num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching)
    runner = ScriptedRunner()
    sched.add_request(make_request("a", prompt_of(4, 1), max_tokens=6))
    sched.add_request(make_request("b", prompt_of(4, 30), max_tokens=6))
    return sched, runner


def test_preemption_frees_the_latest_request_and_resumes_it_with_all_its_tokens():
    sched, runner = _decode_pair(num_blocks=4, enable_prefix_caching=False)
    b = sched.get_request("b")
    outputs = []
    for _ in range(5):  # both decode until each holds 2 full blocks (9 tokens)
        so, outs = step(sched, runner)
        assert so.preempted_req_ids == frozenset()
        outputs += outs
    assert b.num_tokens == 9 and sched.block_manager.num_free_blocks == 0

    so, outs = step(sched, runner)  # a needs a third block: b is preempted for it
    assert so.preempted_req_ids == {"b"}
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.spec_token_ids) == (0, [])
    assert sched.stats.num_preemptions == 1
    assert [o.finished for o in outs] == [True]  # a reached max_tokens

    tokens_before = tuple(b.all_token_ids)
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.token_ids == tokens_before
    assert len(new.token_ids) == 9 and new.prompt_len == 4
    # Free list after a finished: b's head block 1, then a's blocks tail first.
    assert (new.num_computed_tokens, new.block_ids) == (0, (1, 3, 2))
    assert so.num_scheduled_tokens["b"] == 9
    assert so.finished_req_ids == {"a"}
    assert outs[0].finished and outs[0].finish_reason == "length"
    assert b.output_token_ids == reference_tokens(prompt_of(4, 30), 6)
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_preempted_request_reuses_its_cached_head_blocks():
    sched, runner = _decode_pair(num_blocks=4, enable_prefix_caching=True)
    for _ in range(6):
        step(sched, runner)
    b = sched.get_request("b")
    assert b.status is RequestStatus.PREEMPTED
    # b freed tail first (block 3, then 1); a's growth took block 3, block 1 is still cached.
    so, _ = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids[0]) == (4, 1)
    assert so.num_scheduled_tokens["b"] == 5
    assert b.num_cached_tokens == 4
    run_to_completion(sched, runner)
    assert sched.stats.num_prefix_cache_hit_tokens == 4
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize("num_blocks", [5, 6, 8])
@pytest.mark.parametrize("budget", [3, 8, 64])
def test_constrained_runs_produce_the_same_tokens_as_an_unconstrained_run(num_blocks, budget):
    prompts = {f"r{i}": prompt_of(3 + 2 * i, 5 * i) for i in range(5)}
    max_tokens = {f"r{i}": 3 + i for i in range(5)}

    def run(**kwargs) -> tuple[dict[str, Result], int]:
        sched = make_scheduler(**kwargs)
        runner = ScriptedRunner()
        for rid, prompt in prompts.items():
            sched.add_request(make_request(rid, prompt, max_tokens=max_tokens[rid]))
        results = run_to_completion(sched, runner)
        sched.block_manager.check_no_leaks()
        assert runner.mirrors == {}
        return results, sched.stats.num_preemptions

    expected, preemptions = run(num_blocks=64)
    assert preemptions == 0
    for rid, prompt in prompts.items():
        assert expected[rid].tokens == reference_tokens(prompt, max_tokens[rid])
    results, preemptions = run(num_blocks=num_blocks, max_num_batched_tokens=budget)
    assert results == expected
    assert preemptions >= (1 if num_blocks < 8 else 0)


def test_a_request_alone_in_a_full_pool_fails_instead_of_preempting_itself_forever():
    sched = make_scheduler(num_blocks=2, max_model_len=64)
    runner = ScriptedRunner()
    sched.add_request(make_request("a", prompt_of(6), max_tokens=20))
    results = run_to_completion(sched, runner)
    assert results["a"].tokens == reference_tokens(prompt_of(6), 3)
    assert results["a"].finish_reason == "error"
    assert results["a"].error == "request a needs 3 KV blocks for 9 slots but the pool has only 2"
    sched.block_manager.check_no_leaks()


EOS = 63


def _eos_model(eos_at: int):
    """next_token, except that the token at index ``eos_at`` of the history is EOS."""

    def model(history):
        return EOS if len(history) == eos_at else next_token(history) % EOS

    return model


@pytest.mark.parametrize(
    ("params", "expected_len", "reason"),
    [
        ({}, 3, "stop"),
        ({"ignore_eos": True}, 6, "length"),
    ],
)
def test_eos_stops_unless_ignored(params, expected_len, reason):
    sched = make_scheduler(eos_token_id=EOS)
    runner = ScriptedRunner(model=_eos_model(6))
    sched.add_request(make_request("a", prompt_of(4), max_tokens=6, **params))
    result = run_to_completion(sched, runner)["a"]
    assert len(result.tokens) == expected_len and result.tokens[2] == EOS
    assert result.finish_reason == reason
    sched.block_manager.check_no_leaks()


def test_per_request_eos_overrides_the_model_eos():
    sched = make_scheduler(eos_token_id=None)
    runner = ScriptedRunner(model=_eos_model(5))
    request = make_request("a", prompt_of(4), max_tokens=6)
    request.eos_token_id = EOS
    sched.add_request(request)
    result = run_to_completion(sched, runner)["a"]
    assert (len(result.tokens), result.finish_reason) == (2, "stop")
    sched.block_manager.check_no_leaks()


def test_stop_token_ids_and_max_model_len():
    sched = make_scheduler(max_model_len=12)
    runner = ScriptedRunner()
    prompt = prompt_of(4)
    ref = reference_tokens(prompt, 8)
    sched.add_request(make_request("stop", prompt, max_tokens=8, stop_token_ids=(ref[3],)))
    sched.add_request(make_request("len", prompt_of(10), max_tokens=8))
    results = run_to_completion(sched, runner)
    assert results["stop"] == Result(tokens=ref[:4], finish_reason="stop", num_outputs=4)
    assert results["len"] == Result(
        tokens=reference_tokens(prompt_of(10), 2), finish_reason="length", num_outputs=2
    )
    sched.block_manager.check_no_leaks()


def test_tokens_after_a_stop_are_dropped_and_logits_trimmed():
    sched = make_scheduler(eos_token_id=EOS)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5, return_logits=True))
    so = sched.schedule()
    logits = torch.arange(3 * VOCAB, dtype=torch.float32).reshape(3, VOCAB)
    mro = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[EOS]],
        sampled_logits={"a": logits[:1]},
    )
    (out,) = sched.update_from_output(so, mro)
    assert (out.new_token_ids, out.finished, out.finish_reason) == ((EOS,), True, "stop")
    assert torch.equal(out.logits, logits[:1])
    sched.block_manager.check_no_leaks()


def test_logits_only_when_requested():
    sched = make_scheduler()
    runner = ScriptedRunner()
    sched.add_request(make_request("yes", [1, 2, 3], max_tokens=2, return_logits=True))
    sched.add_request(make_request("no", [1, 2, 3], max_tokens=2))
    _, outs = step(sched, runner)
    by_id = {o.req_id: o for o in outs}
    expected = torch.nn.functional.one_hot(torch.tensor(by_id["yes"].new_token_ids), VOCAB)
    assert torch.equal(by_id["yes"].logits, expected.float())
    assert by_id["no"].logits is None
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_abort_in_every_state():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    runner = ScriptedRunner()
    sched.add_request(make_request("running", prompt_of(4), max_tokens=20))
    sched.add_request(make_request("chunking", prompt_of(6), max_tokens=20))
    sched.add_request(make_request("waiting", prompt_of(4), max_tokens=20))
    step(sched, runner)
    assert sched.get_request("chunking").num_computed_tokens == 4
    assert sched.get_request("waiting").status is RequestStatus.WAITING

    outs = sched.abort_requests(["waiting", "chunking", "unknown"])
    assert outs == [
        EngineCoreOutput(req_id="waiting", finished=True, finish_reason="abort"),
        EngineCoreOutput(req_id="chunking", finished=True, finish_reason="abort"),
    ]
    assert sched.abort_requests(["chunking"]) == []  # already finished: no-op
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"waiting", "chunking"}
    assert list(so.num_scheduled_tokens) == ["running"]

    # Aborted between schedule() and update_from_output(): its sample is ignored.
    so = sched.schedule()
    mro = runner.execute(so)
    assert sched.abort_requests(["running"])[0].finish_reason == "abort"
    assert sched.update_from_output(so, mro) == []
    assert not sched.has_unfinished_requests()
    run_to_completion(sched, runner)
    assert runner.mirrors == {}
    sched.block_manager.check_no_leaks()


def test_abort_a_preempted_request():
    sched, runner = _decode_pair(num_blocks=4, enable_prefix_caching=False)
    for _ in range(6):
        step(sched, runner)
    assert sched.get_request("b").status is RequestStatus.PREEMPTED
    assert sched.abort_requests(["b"])[0].finish_reason == "abort"
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_prefix_cache_hit_shares_blocks_and_is_counted():
    sched = make_scheduler()
    runner = ScriptedRunner()
    prompt = prompt_of(9)
    sched.add_request(make_request("a", prompt, max_tokens=4))
    results: dict[str, Result] = {}
    collect(results, step(sched, runner)[1])
    sched.add_request(make_request("b", [*prompt[:8], 50, 51], max_tokens=4))
    so, outs = step(sched, runner)
    collect(results, outs)
    (new,) = so.scheduled_new_reqs
    a_blocks = sched.block_manager.get_block_ids("a")
    assert (new.num_computed_tokens, new.block_ids[:2]) == (8, tuple(a_blocks[:2]))
    assert so.num_scheduled_tokens["b"] == 2
    assert [sched.block_manager.ref_count(b) for b in a_blocks[:2]] == [2, 2]
    assert sched.get_request("b").num_cached_tokens == 8
    stats = sched.stats
    assert (stats.num_prefix_cache_hit_tokens, stats.num_prefix_cache_queried_tokens) == (8, 19)
    run_to_completion(sched, runner, results=results)
    assert results["b"].tokens == reference_tokens([*prompt[:8], 50, 51], 4)
    sched.block_manager.check_no_leaks()


def test_zero_token_steps_are_valid_outputs():
    sched = make_scheduler()
    so = sched.schedule()
    assert (so.total_num_scheduled_tokens, so.kv_connector_metadata) == (0, None)
    assert sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT) == []
    assert not sched.has_pending_work()
    sched.block_manager.check_no_leaks()


def test_bad_requests_are_refused_with_their_id():
    sched = make_scheduler(num_blocks=5, max_model_len=20)
    with pytest.raises(ValueError, match=r"^request e: empty prompt$"):
        sched.add_request(make_request("e", []))
    with pytest.raises(
        ValueError,
        match=r"^request v: prompt token 64 at position 1 is outside the vocabulary \[0, 64\)$",
    ):
        sched.add_request(make_request("v", [1, 64]))
    with pytest.raises(
        ValueError,
        match=r"^request v: prompt token -1 at position 0 is outside the vocabulary",
    ):
        sched.add_request(make_request("v", [-1]))
    with pytest.raises(
        ValueError,
        match=r"^request l: prompt has 20 tokens but max_model_len is 20 \(no room to generate\)$",
    ):
        sched.add_request(make_request("l", prompt_of(20)))
    with pytest.raises(
        ValueError,
        match=r"^request big: needs 5 KV blocks \(17 prompt tokens \+ 0 lookahead, block_size 4\) "
        r"but the pool has only 4$",
    ):
        make_scheduler(num_blocks=4).add_request(make_request("big", prompt_of(17)))
    sched.add_request(make_request("d", [1, 2]))
    with pytest.raises(ValueError, match=r"^request d: duplicate request id$"):
        sched.add_request(make_request("d", [1, 2]))
    assert sched.num_unfinished_requests == 1
    # prompt + max_tokens beyond max_model_len is accepted; generation stops at the limit.
    sched.add_request(make_request("long", prompt_of(15), max_tokens=100))
    results = run_to_completion(sched, ScriptedRunner())
    assert (len(results["long"].tokens), results["long"].finish_reason) == (5, "length")
    sched.block_manager.check_no_leaks()


def test_runner_output_that_does_not_match_the_step_is_refused_before_any_change():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", prompt_of(6)))
    so = sched.schedule()
    chunk = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[1]])
    with pytest.raises(
        ValueError,
        match=r"^model runner output for request a: sampled 1 tokens in a chunk that stops "
        r"short of its last token \(4 of 6 computed\)$",
    ):
        sched.update_from_output(so, chunk)
    sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    so = sched.schedule()
    with pytest.raises(
        ValueError,
        match=r"^model runner output for request a: expected 1 to 1 sampled tokens, got 0$",
    ):
        sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    two = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[1, 2]])
    with pytest.raises(ValueError, match=r"expected 1 to 1 sampled tokens, got 2$"):
        sched.update_from_output(so, two)
    assert sched.get_request("a").output_token_ids == []
    sched.abort_requests(["a"])
    sched.block_manager.check_no_leaks()


def test_request_satisfies_the_connector_protocol_and_status_reasons():
    request = make_request("a", [1, 2])
    assert isinstance(request, KVRequest)
    assert (request.num_tokens, request.num_prompt_tokens, request.finish_reason) == (2, 2, None)
    request.append_output_token(7)
    assert (request.all_token_ids, request.num_tokens, request.num_output_tokens) == (
        [1, 2, 7],
        3,
        1,
    )
    reasons = {s: (s.is_finished, s.finish_reason) for s in RequestStatus}
    assert reasons == {
        RequestStatus.WAITING: (False, None),
        RequestStatus.WAITING_WITH_KV: (False, None),
        RequestStatus.WAITING_FOR_REMOTE_KVS: (False, None),
        RequestStatus.RUNNING: (False, None),
        RequestStatus.PREEMPTED: (False, None),
        RequestStatus.FINISHED_STOPPED: (True, "stop"),
        RequestStatus.FINISHED_LENGTH: (True, "length"),
        RequestStatus.FINISHED_ABORTED: (True, "abort"),
        RequestStatus.FINISHED_ERROR: (True, "error"),
    }
    with pytest.raises(ValueError, match=r"^request_id must be a non-empty str, got ''$"):
        make_request("", [1])


def test_scheduler_constructor_validation():
    with pytest.raises(ValueError, match=r"^max_model_len must be >= 2, got 1$"):
        make_scheduler(max_model_len=1)
