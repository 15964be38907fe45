"""Scheduler bookkeeping of speculative decoding: drafts scheduled, verified, rolled back and
trimmed. The scripted runner keeps KV per slot, so a missed rollback fails its KV check."""

from __future__ import annotations

import pytest
from engine_helpers.scheduler_helpers import (
    ScriptedRunner,
    make_request,
    make_scheduler,
    next_token,
    prompt_of,
    reference_tokens,
    run_to_completion,
    step,
)

from kvtransfer.engine.config import SpeculativeConfig
from kvtransfer.engine.outputs import ModelRunnerOutput
from kvtransfer.engine.scheduler.request import EngineCoreOutput
from kvtransfer.engine.scheduler_output import CachedRequestData

pytestmark = pytest.mark.unit

WRONG = 0


def drafter(k: int, wrong_at: int | None = None, model=next_token):
    """Proposes the model's own continuation, with a wrong token at index ``wrong_at``."""

    def propose(history):
        history = list(history)
        drafts = []
        for i in range(k):
            token = model(history)
            if i == wrong_at:
                token = WRONG if token != WRONG else WRONG + 1
            drafts.append(token)
            history.append(token)
        return drafts

    return propose


def ngram(k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k)


def test_rejected_drafts_roll_back_num_computed_tokens():
    sched = make_scheduler(speculative=ngram())
    runner = ScriptedRunner(drafter=drafter(3, wrong_at=1))
    prompt = prompt_of(4)
    ref = reference_tokens(prompt, 10)
    request = make_request("a", prompt, max_tokens=10)
    sched.add_request(request)

    so, outs = step(sched, runner)
    assert outs == [EngineCoreOutput(req_id="a", new_token_ids=(ref[0],))]
    third = next_token([*prompt, ref[0], ref[1], WRONG])
    assert request.spec_token_ids == [ref[1], WRONG, third]
    assert (request.num_computed_tokens, request.num_tokens) == (4, 5)

    so, outs = step(sched, runner)
    assert dict(so.num_scheduled_tokens) == {"a": 4}
    assert dict(so.scheduled_spec_decode_tokens) == {"a": (ref[1], WRONG, third)}
    assert so.scheduled_cached_reqs == (
        CachedRequestData(
            req_id="a", new_token_ids=(ref[0],), new_block_ids=(1,), num_computed_tokens=4
        ),
    )
    # One draft accepted plus the target's correction: 2 tokens, 2 drafts rejected.
    assert outs == [
        EngineCoreOutput(
            req_id="a", new_token_ids=(ref[1], ref[2]), num_draft_tokens=3, num_accepted_tokens=1
        )
    ]
    assert (request.num_computed_tokens, request.num_tokens) == (6, 7)

    so, _ = step(sched, runner)
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 6
    assert so.scheduled_cached_reqs[0].new_token_ids == (ref[1], ref[2])
    stats = sched.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 2)
    results = run_to_completion(sched, runner)
    assert request.output_token_ids == ref
    assert results["a"].finish_reason == "length"
    sched.block_manager.check_no_leaks()


def test_all_drafts_accepted_and_drafts_trimmed_near_max_tokens():
    sched = make_scheduler(speculative=ngram())
    runner = ScriptedRunner(drafter=drafter(3))
    prompt = prompt_of(4)
    ref = reference_tokens(prompt, 4)
    request = make_request("a", prompt, max_tokens=4)
    sched.add_request(request)
    step(sched, runner)
    # 3 outputs left: 2 drafts (+1 bonus token) reach max_tokens exactly.
    assert request.spec_token_ids == ref[1:3]
    so, outs = step(sched, runner)
    assert dict(so.scheduled_spec_decode_tokens) == {"a": tuple(ref[1:3])}
    assert outs == [
        EngineCoreOutput(
            req_id="a",
            new_token_ids=tuple(ref[1:]),
            finished=True,
            finish_reason="length",
            num_draft_tokens=2,
            num_accepted_tokens=2,
        )
    ]
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_drafts_trimmed_near_max_model_len():
    sched = make_scheduler(speculative=ngram(), max_model_len=7)
    runner = ScriptedRunner(drafter=drafter(3))
    request = make_request("a", prompt_of(4), max_tokens=50)
    sched.add_request(request)
    step(sched, runner)
    assert len(request.spec_token_ids) == 1  # 5 tokens + 1 draft + 1 bonus = 7
    _, outs = step(sched, runner)
    assert (len(outs[0].new_token_ids), outs[0].finish_reason) == (2, "length")
    assert request.num_tokens == 7
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_one_output_left_means_no_drafts():
    sched = make_scheduler(speculative=ngram())
    runner = ScriptedRunner(drafter=drafter(3))
    request = make_request("a", prompt_of(4), max_tokens=2)
    sched.add_request(request)
    step(sched, runner)
    assert request.spec_token_ids == []
    so, _ = step(sched, runner)
    assert dict(so.scheduled_spec_decode_tokens) == {}
    sched.block_manager.check_no_leaks()


def test_tokens_after_a_stop_token_inside_the_accepted_run_are_dropped():
    eos = 63
    sched = make_scheduler(speculative=ngram(), eos_token_id=eos)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    so = sched.schedule()
    mro = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[5]],
        spec_token_ids=[[6, eos, 7]],
    )
    sched.update_from_output(so, mro)
    so = sched.schedule()
    assert dict(so.scheduled_spec_decode_tokens) == {"a": (6, eos, 7)}
    mro = ModelRunnerOutput(
        req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[6, eos, 7, 8]]
    )
    (out,) = sched.update_from_output(so, mro)
    assert out == EngineCoreOutput(
        req_id="a",
        new_token_ids=(6, eos),
        finished=True,
        finish_reason="stop",
        num_draft_tokens=3,
        num_accepted_tokens=3,
    )
    sched.block_manager.check_no_leaks()


def test_token_budget_cuts_drafts_and_drops_the_rest():
    sched = make_scheduler(speculative=ngram(), max_num_batched_tokens=2)
    runner = ScriptedRunner(drafter=drafter(3))
    request = make_request("a", prompt_of(4), max_tokens=10)
    sched.add_request(request)
    step(sched, runner)
    step(sched, runner)
    assert len(request.spec_token_ids) == 3
    so, outs = step(sched, runner)
    ref = reference_tokens(prompt_of(4), 3)
    assert dict(so.num_scheduled_tokens) == {"a": 2}
    assert dict(so.scheduled_spec_decode_tokens) == {"a": (ref[1],)}
    assert outs[0].new_token_ids == (ref[1], ref[2])
    run_to_completion(sched, runner)
    sched.block_manager.check_no_leaks()


def test_draft_model_lookahead_slots_are_allocated_and_checked_at_admission():
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3)
    sched = make_scheduler(speculative=spec)
    # The runner asserts every step's table covers computed + scheduled + 3 slots, and writes
    # garbage there that must never be published or counted as computed.
    runner = ScriptedRunner(drafter=drafter(3, wrong_at=2), num_lookahead=3)
    sched.add_request(make_request("a", prompt_of(4), max_tokens=12))
    sched.add_request(make_request("b", prompt_of(4), max_tokens=12))
    results = run_to_completion(sched, runner)
    assert results["a"].tokens == results["b"].tokens == reference_tokens(prompt_of(4), 12)
    sched.block_manager.check_no_leaks()

    small = make_scheduler(speculative=spec, num_blocks=4)
    with pytest.raises(
        ValueError,
        match=r"^request a: needs 5 KV blocks \(14 prompt tokens \+ 3 lookahead, block_size 4\) "
        r"but the pool has only 4$",
    ):
        small.add_request(make_request("a", prompt_of(14)))
    small.block_manager.check_no_leaks()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_speculation_and_preemption_keep_outputs_identical(method, wrong_at):
    prompts = {f"r{i}": prompt_of(3 + 3 * i, 7 * i) for i in range(4)}

    def run(num_blocks: int, speculative: SpeculativeConfig | None) -> tuple[dict, int]:
        sched = make_scheduler(
            num_blocks=num_blocks, speculative=speculative, max_num_batched_tokens=10
        )
        lookahead = 3 if speculative and speculative.method == "draft" else 0
        runner = ScriptedRunner(
            drafter=drafter(3, wrong_at) if speculative else None, num_lookahead=lookahead
        )
        for rid, prompt in prompts.items():
            sched.add_request(make_request(rid, prompt, max_tokens=9))
        results = run_to_completion(sched, runner)
        sched.block_manager.check_no_leaks()
        tokens = {rid: (r.tokens, r.finish_reason) for rid, r in results.items()}
        return tokens, sched.stats.num_preemptions

    expected, preemptions = run(64, None)
    assert preemptions == 0
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3)
    assert run(64, spec) == (expected, 0)
    results, preemptions = run(8, spec)
    assert results == expected and preemptions >= 1
