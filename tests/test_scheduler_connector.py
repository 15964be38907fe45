"""Scheduler + KV connector (scheduler role): matched tokens, asynchronous and synchronous
loads, load failures under both policies, delayed frees, aborts while loading, hook errors.

`ScriptedConnector` answers what each test scripts; `ScriptedRunner` performs the loads its
metadata asks for (writing valid KV, or garbage where a load fails) and checks every position
the scheduler calls computed, so trusting a failed load fails the test.
"""

from __future__ import annotations

import pytest
from engine_helpers.scheduler_helpers import (
    LoadSpec,
    Result,
    ScriptedConnector,
    ScriptedMetadata,
    ScriptedRunner,
    collect,
    make_request,
    make_scheduler,
    prompt_of,
    reference_tokens,
    run_to_completion,
    step,
)

from kvtransfer.engine.scheduler.request import EngineCoreOutput, RequestStatus

pytestmark = pytest.mark.unit

PROMPT = prompt_of(10)
REF = reference_tokens(PROMPT, 4)
LOAD_FAILED = "KV load failed for request a (kv_load_failure_policy=fail)"


def _setup(policy: str = "fail", **kwargs):
    connector = ScriptedConnector(policy)
    sched = make_scheduler(connector=connector, **kwargs)
    return connector, sched, ScriptedRunner()


def _warm_prefix(sched, runner, prompt):
    """Run a request to completion so its full blocks sit in the prefix cache."""
    sched.add_request(make_request("warm", prompt, max_tokens=1))
    run_to_completion(sched, runner)


def test_unknown_match_keeps_the_request_waiting_and_asks_again():
    conn, sched, runner = _setup()
    conn.matches["a"] = [(None, False), (None, False), (0, False)]
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    sched.add_request(make_request("b", prompt_of(5, 30), max_tokens=2))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["b"]
    assert sched.get_request("a").status is RequestStatus.WAITING
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["b"]
    so, _ = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 10}
    assert conn.hook_calls("match") == [
        ("match", "a", 0),
        ("match", "b", 0),
        ("match", "a", 0),
        ("match", "a", 0),
    ]
    # Every admission tells the connector about the blocks, also without external tokens.
    assert conn.hook_calls("alloc") == [("alloc", "b", (0, 1), 0), ("alloc", "a", (2, 3, 4), 0)]
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_async_load_of_the_whole_prompt_parks_then_recomputes_the_last_token():
    conn, sched, runner = _setup()
    conn.matches["a"] = [(10, True)]
    request = make_request("a", PROMPT, max_tokens=4)
    sched.add_request(request)

    so, outs = step(sched, runner)
    assert (so.total_num_scheduled_tokens, outs) == (0, [])
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.hook_calls("alloc") == [("alloc", "a", (0, 1, 2), 10)]
    assert so.kv_connector_metadata == ScriptedMetadata(
        step=1, loads=(LoadSpec("a", tuple(PROMPT), (0, 1, 2), 0, 10, True),)
    )
    so, _ = step(sched, runner)  # the load is still in flight
    assert so.total_num_scheduled_tokens == 0
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    runner.finish_load("a")
    so, outs = step(sched, runner)
    assert (so.total_num_scheduled_tokens, outs) == (0, [])
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING_WITH_KV, 9)
    assert sched.block_manager.num_cached_blocks == 2  # loaded full blocks are published

    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids, new.token_ids) == (9, (0, 1, 2), tuple(PROMPT))
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[0],))]
    results = run_to_completion(sched, runner)
    assert request.output_token_ids == REF and results["a"].finish_reason == "length"
    assert len(conn.hook_calls("match")) == 1
    sched.block_manager.check_no_leaks()


def test_a_request_continuing_a_prefill_loads_every_prompt_token_and_computes_none():
    """First token from prefill: the request arrives with that token; the load brings the KV
    of every prompt token, and its first step computes only the first token's position."""
    conn, sched, runner = _setup()
    conn.matches["a"] = [(10, True)]
    request = make_request("a", PROMPT, max_tokens=4)
    request.append_output_token(REF[0])
    sched.add_request(request)
    so, _ = step(sched, runner)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert conn.hook_calls("alloc") == [("alloc", "a", (0, 1, 2), 10)]
    runner.finish_load("a")
    step(sched, runner)
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING_WITH_KV, 10)
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.token_ids) == (10, (*PROMPT, REF[0]))
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[1],))]
    results = run_to_completion(sched, runner)
    assert request.output_token_ids == REF and results["a"].finish_reason == "length"
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize("first_token_arrives", [True, False], ids=["continued", "abandoned"])
def test_a_request_awaiting_its_first_token_loads_then_waits_for_it(first_token_arrives):
    """Dispatched alongside its prefill: the KV loads while the prefill still runs, then the
    request waits, computing nothing, until the prefill's token arrives (or it is told none
    will, and computes its first token itself)."""
    conn, sched, runner = _setup()
    conn.matches["a"] = [(10, True)]
    request = make_request("a", PROMPT, max_tokens=4)
    request.awaits_generated = True
    sched.add_request(request)
    so, _ = step(sched, runner)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    runner.finish_load("a")
    step(sched, runner)
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING_WITH_KV, 10)
    # The whole load happened before the first token came: all of it overlapped the prefill.
    assert request.kv_stats.overlapped_s == request.kv_stats.load_wait_s
    for _ in range(3):  # loaded, but nothing to compute until continued
        so, outs = step(sched, runner)
        assert (so.total_num_scheduled_tokens, outs) == (0, [])
    with pytest.raises(KeyError, match="request b is not waiting for generated tokens"):
        sched.continue_request("b", [REF[0]])
    with pytest.raises(ValueError, match="leave nothing to generate with max_tokens 4"):
        sched.continue_request("a", REF)
    if first_token_arrives:
        sched.continue_request("a", [REF[0]])
        so, outs = step(sched, runner)
        assert dict(so.num_scheduled_tokens) == {"a": 1}
        assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[1],))]
    else:
        sched.continue_request("a", [])
        so, outs = step(sched, runner)
        assert dict(so.num_scheduled_tokens) == {"a": 1}  # the last prompt token, again
        assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[0],))]
    with pytest.raises(KeyError):
        sched.continue_request("a", [REF[1]])  # once only
    run_to_completion(sched, runner)
    assert request.output_token_ids == REF
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize(
    ("generated", "max_tokens", "message"),
    [
        ([5], 1, "1 generated tokens leave nothing to generate with max_tokens 1"),
        ([5, 0], 4, "generated tokens hold the end-of-sequence token 0"),
        ([5, 10_000], 4, "generated token 10000 at position 1 is outside the vocabulary"),
    ],
)
def test_generated_tokens_that_end_the_request_are_refused(generated, max_tokens, message):
    _, sched, _ = _setup(eos_token_id=0)
    request = make_request("a", PROMPT, max_tokens=max_tokens)
    request.extend_output_tokens(generated)
    with pytest.raises(ValueError, match=message):
        sched.add_request(request)
    assert sched.get_request("a") is None


def test_async_load_after_a_local_prefix_hit():
    conn, sched, runner = _setup()
    prompt = [*PROMPT[:8], 40, 41, 42, 43, 44, 45]
    _warm_prefix(sched, runner, PROMPT[:9])
    conn.matches["a"] = [(4, True)]
    request = make_request("a", prompt, max_tokens=3)
    sched.add_request(request)
    step(sched, runner)
    assert conn.hook_calls("match")[-1] == ("match", "a", 8)
    (alloc,) = [c for c in conn.hook_calls("alloc") if c[1] == "a"]
    warm_blocks = alloc[2][:2]
    assert (len(alloc[2]), alloc[3]) == (3, 4)
    assert request.num_cached_tokens == 8
    runner.finish_load("a")
    step(sched, runner)
    assert request.num_computed_tokens == 12
    so, _ = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids[:2]) == (12, warm_blocks)
    assert so.num_scheduled_tokens["a"] == 2
    run_to_completion(sched, runner)
    assert request.output_token_ids == reference_tokens(prompt, 3)
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize(("offered", "computed"), [(6, 6), (10, 9)])
def test_sync_load_counts_as_computed_and_schedules_the_rest(offered, computed):
    conn, sched, runner = _setup()
    conn.matches["a"] = [(offered, False)]
    request = make_request("a", PROMPT, max_tokens=4)
    sched.add_request(request)
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == computed
    assert dict(so.num_scheduled_tokens) == {"a": 10 - computed}
    assert conn.hook_calls("alloc") == [("alloc", "a", (0, 1, 2), offered)]
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[0],))]
    run_to_completion(sched, runner)
    assert request.output_token_ids == REF
    sched.block_manager.check_no_leaks()


def test_failed_async_load_with_fail_policy_finishes_with_an_error():
    conn, sched, runner = _setup("fail")
    conn.matches["a"] = [(10, True)]
    sched.add_request(make_request("a", PROMPT))
    step(sched, runner)
    runner.finish_load("a", failed=True)
    _, outs = step(sched, runner)
    assert outs == [
        EngineCoreOutput(req_id="a", finished=True, finish_reason="error", error=LOAD_FAILED)
    ]
    assert conn.hook_calls("finished") == [("finished", "a", (0, 1, 2))]
    assert sched.block_manager.num_used_blocks == 0
    assert sched.block_manager.num_cached_blocks == 0
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize("how", ["failed_recving", "invalid_block", "invalid_block_earlier"])
def test_failed_async_load_with_recompute_prefills_locally_from_the_local_prefix(how):
    conn, sched, runner = _setup("recompute")
    _warm_prefix(sched, runner, PROMPT[:5])  # caches PROMPT[:4]
    conn.matches["a"] = [(6, True)]
    request = make_request("a", PROMPT, max_tokens=4)
    sched.add_request(request)
    step(sched, runner)
    blocks = tuple(sched.block_manager.get_block_ids("a"))
    if how == "failed_recving":
        runner.finish_load("a", failed=True)
    elif how == "invalid_block":
        runner.finish_load("a", invalid_blocks=[blocks[2]])
    else:
        runner.report_invalid_blocks([blocks[1]])
        step(sched, runner)
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS  # still loading
        runner.finish_load("a")
    _, outs = step(sched, runner)
    assert outs == []
    assert (request.status, request.num_computed_tokens) == (RequestStatus.WAITING_WITH_KV, 4)
    assert request.skip_connector
    assert sched.block_manager.num_cached_blocks == 1  # only the local prefix
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (4, blocks)
    assert dict(so.num_scheduled_tokens) == {"a": 6}
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[0],))]
    run_to_completion(sched, runner)
    assert request.output_token_ids == REF
    assert [c[1] for c in conn.hook_calls("match")] == ["warm", "a"]
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_invalid_blocks_after_an_async_load_apply_the_policy(policy):
    conn, sched, runner = _setup(policy)
    conn.matches["a"] = [(10, True)]
    request = make_request("a", PROMPT, max_tokens=4)
    sched.add_request(request)
    step(sched, runner)
    runner.finish_load("a", invalid_blocks=[1])
    _, outs = step(sched, runner)
    results = run_to_completion(sched, runner)
    if policy == "fail":
        assert outs == [
            EngineCoreOutput(req_id="a", finished=True, finish_reason="error", error=LOAD_FAILED)
        ]
    else:
        assert outs == []
        assert results["a"] == Result(tokens=REF, finish_reason="length", num_outputs=4)
    sched.block_manager.check_no_leaks()


def test_invalid_blocks_of_a_sync_load_with_fail_policy():
    conn, sched, runner = _setup("fail")
    conn.matches["a"] = [(8, False)]
    sched.add_request(make_request("a", PROMPT))
    runner.fail_sync_load("a", [1])
    _, outs = step(sched, runner)
    assert outs == [
        EngineCoreOutput(req_id="a", finished=True, finish_reason="error", error=LOAD_FAILED)
    ]
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_invalid_blocks_of_a_sync_load_with_recompute_discard_the_step_and_redo_it():
    conn, sched, runner = _setup("recompute")
    conn.matches["a"] = [(8, False)]
    request = make_request("a", PROMPT, max_tokens=4)
    sched.add_request(request)
    runner.fail_sync_load("a", [1])
    so, outs = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 2}
    assert outs == []  # the token sampled from garbage KV is dropped
    assert (request.num_computed_tokens, request.output_token_ids) == (0, [])
    assert sched.block_manager.num_cached_blocks == 0
    so, outs = step(sched, runner)
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 0
    assert dict(so.num_scheduled_tokens) == {"a": 10}
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(REF[0],))]
    run_to_completion(sched, runner)
    assert request.output_token_ids == REF
    sched.block_manager.check_no_leaks()


def test_delayed_free_keeps_blocks_until_finished_sending():
    conn, sched, runner = _setup()
    params = {"remote_engine_id": "prefill-0", "remote_block_ids": [0, 1, 2]}
    conn.finish_answers["a"] = (True, params)
    sched.add_request(make_request("a", PROMPT, max_tokens=1))
    _, outs = step(sched, runner)
    assert outs == [
        EngineCoreOutput(
            req_id="a",
            new_token_ids=(REF[0],),
            finished=True,
            finish_reason="length",
            kv_transfer_params=params,
        )
    ]
    assert conn.hook_calls("finished") == [("finished", "a", (0, 1, 2))]
    assert not sched.has_unfinished_requests() and sched.has_pending_work()
    with pytest.raises(ValueError, match=r"^request a: duplicate request id$"):
        sched.add_request(make_request("a", PROMPT))
    for _ in range(3):
        so, _ = step(sched, runner)
        assert so.total_num_scheduled_tokens == 0
        assert sched.block_manager.get_block_ids("a") == [0, 1, 2]
    runner.finish_send("a")
    step(sched, runner)
    assert sched.block_manager.get_block_ids("a") == []
    assert not sched.has_pending_work()
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize("delay_free", [False, True])
def test_abort_while_loading_keeps_blocks_until_finished_recving(delay_free):
    conn, sched, runner = _setup()
    conn.matches["a"] = [(10, True)]
    conn.finish_answers["a"] = (delay_free, None)
    sched.add_request(make_request("a", PROMPT))
    step(sched, runner)
    assert sched.abort_requests(["a"]) == [
        EngineCoreOutput(req_id="a", finished=True, finish_reason="abort")
    ]
    assert conn.hook_calls("finished") == [("finished", "a", (0, 1, 2))]
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert sched.block_manager.get_block_ids("a") == [0, 1, 2]
    assert sched.has_pending_work() and not sched.has_unfinished_requests()
    runner.finish_load("a")
    step(sched, runner)
    if delay_free:
        assert sched.block_manager.get_block_ids("a") == [0, 1, 2]
        runner.finish_send("a")
        step(sched, runner)
    assert sched.block_manager.get_block_ids("a") == []
    assert not sched.has_pending_work()
    sched.block_manager.check_no_leaks()


def test_abort_running_and_waiting_requests_with_a_connector():
    conn, sched, runner = _setup()
    sched.add_request(make_request("run", PROMPT, max_tokens=8))
    step(sched, runner)
    conn.matches["wait"] = [(None, False)]
    sched.add_request(make_request("wait", PROMPT))
    step(sched, runner)
    outs = sched.abort_requests(["run", "wait"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    assert conn.hook_calls("finished") == [("finished", "run", (0, 1, 2)), ("finished", "wait", ())]
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_build_connector_meta_runs_once_per_schedule_including_empty_steps():
    conn, sched, runner = _setup()
    so = sched.schedule()
    assert so.kv_connector_metadata == ScriptedMetadata(step=1)
    sched.update_from_output(so, runner.execute(so))
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    steps = [so, *(step(sched, runner)[0] for _ in range(4))]
    assert [s.kv_connector_metadata.step for s in steps] == [1, 2, 3, 4, 5]
    assert [s.total_num_scheduled_tokens for s in steps] == [0, 10, 1, 0, 0]
    assert conn.num_build_calls == 5
    # The aggregated output is shown to the connector once per update, even when empty.
    assert len(conn.connector_outputs) == 5
    sched.block_manager.check_no_leaks()


def test_too_many_external_tokens_fail_the_request_naming_the_connector():
    conn, sched, runner = _setup()
    conn.matches["a"] = [(11, False)]
    sched.add_request(make_request("a", PROMPT))
    sched.add_request(make_request("b", prompt_of(3), max_tokens=1))
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["b"]
    assert outs[0] == EngineCoreOutput(
        req_id="a",
        finished=True,
        finish_reason="error",
        error="KV connector ScriptedConnector offered 11 external tokens for request a, but "
        "only 10 of its 10 tokens are not cached locally (0 are)",
    )
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


@pytest.mark.parametrize(
    "hook", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]
)
def test_a_raising_hook_fails_only_that_request(hook):
    conn, sched, runner = _setup()
    conn.raise_for[hook] = {"a"}
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    sched.add_request(make_request("b", prompt_of(3), max_tokens=2))
    results = run_to_completion(sched, runner)
    assert results["a"].finish_reason == "error"
    assert results["a"].error == (
        f"KV connector ScriptedConnector.{hook} raised for request a: RuntimeError: {hook} exploded"
    )
    assert results["b"] == Result(
        tokens=reference_tokens(prompt_of(3), 2), finish_reason="length", num_outputs=2
    )
    if hook == "request_finished":
        assert results["a"].tokens == REF[:2]
    sched.block_manager.check_no_leaks()


def test_has_pending_work_tracks_loads_and_borrows():
    conn, sched, runner = _setup()
    assert not sched.has_pending_work()
    conn.matches["a"] = [(10, True)]
    sched.add_request(make_request("a", PROMPT, max_tokens=1))
    results: dict[str, Result] = {}
    collect(results, step(sched, runner)[1])
    assert sched.has_pending_work() and sched.num_unfinished_requests == 1
    runner.finish_load("a")
    run_to_completion(sched, runner, results=results)
    assert results["a"].tokens == REF[:1]
    assert not sched.has_pending_work()
    sched.block_manager.check_no_leaks()


def test_a_loaded_request_still_runs_when_the_pool_cannot_take_the_queue_head():
    conn, sched, runner = _setup(num_blocks=4, max_num_seqs=1)
    conn.matches["b"] = [(8, True)]
    sched.add_request(make_request("b", PROMPT[:8], max_tokens=2))
    sched.add_request(make_request("a", prompt_of(4, 30), max_tokens=8))
    results: dict[str, Result] = {}
    so, outs = step(sched, runner)
    collect(results, outs)
    assert list(so.num_scheduled_tokens) == ["a"]
    runner.finish_load("b")
    for _ in range(5):
        so, outs = step(sched, runner)
        collect(results, outs)
    # a, alone in the running set, preempted itself for a block the loaded b holds.
    assert so.preempted_req_ids == {"a"}
    so, outs = step(sched, runner)
    collect(results, outs)
    # The pool cannot take a back, but b already holds its blocks: it runs.
    assert list(so.num_scheduled_tokens) == ["b"]
    run_to_completion(sched, runner, results=results)
    assert results["a"].tokens == reference_tokens(prompt_of(4, 30), 8)
    assert results["b"].tokens == reference_tokens(PROMPT[:8], 2)
    sched.block_manager.check_no_leaks()
