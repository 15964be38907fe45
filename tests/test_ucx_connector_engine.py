"""Prefill on a producer engine, decode on a consumer engine, through `UcxConnector` (real gRPC
on 127.0.0.1, real UCX, in-process single-worker engines): the consumer's greedy tokens equal a
colocated run's, its pulled KV equals the producer's bytes (drafter layers included), failures
follow ``kv_load_failure_policy`` and neither engine leaks a block."""

from __future__ import annotations

import logging
import re
import socket

import pytest
import torch
from engine_helpers.builtin import (
    BLOCK_SIZE,
    DECODE,
    DRAFT,
    PREFILL,
    PROMPTS,
    REMOTE_DECODE,
    colocated,
    engine_config,
    finish,
    worker_caches,
)
from ucx_helpers.engines import kv_config, pd_run, prefill, scheduler_half, stepping, worker_half
from waiting import step_until, wait_until

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.ucx.metadata import prompt_digest
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.scheduler.request import RequestStatus

pytestmark = pytest.mark.integration

WAIT_S = 30.0


def blocks_of(prompt: list[int]) -> int:
    return -(-len(prompt) // BLOCK_SIZE)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in colocated(PROMPTS)]


@pytest.fixture(scope="module")
def producer():
    with LLM(engine_config(kv_config("kv_producer", "prefill"))) as llm:
        yield llm


@pytest.fixture(scope="module")
def short_lease_producer():
    """For fault tests whose consumer never tells the producer: its lease frees the blocks."""
    with LLM(engine_config(kv_config("kv_producer", "prefill-lease", kv_lease_s=0.5))) as llm:
        yield llm


def consumer(engine_id: str = "decode", policy: str = "fail", **extra) -> LLM:
    return LLM(engine_config(kv_config("kv_consumer", engine_id, policy, **extra)))


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_producer_keeps_blocks_until_the_consumer_is_done(producer, expected):
    core = producer.engine
    half = scheduler_half(core)
    outputs = prefill(producer, PROMPTS)
    host, port = half.address.rsplit(":", 1)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        params = output.kv_transfer_params
        assert params == {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_request_id": output.request_id,
            "remote_block_ids": core.scheduler.block_manager.get_block_ids(output.request_id),
            "remote_host": host,
            "remote_port": int(port),
            "remote_generation": half.book.generation,
            "tp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(prompt),
            "remote_kv_secret": params["remote_kv_secret"],
            "remote_prompt_digest": prompt_digest(prompt),
        }
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", params["remote_kv_secret"])
        assert len(params["remote_block_ids"]) == blocks_of(prompt)
    secrets = {o.kv_transfer_params["remote_kv_secret"] for o in outputs}
    assert len(secrets) == len(PROMPTS)
    num_blocks = sum(blocks_of(p) for p in PROMPTS)
    assert core.scheduler.block_manager.num_used_blocks == num_blocks
    assert len(half.leases) == len(PROMPTS)
    # Nobody pulled yet: stepping the producer frees nothing.
    for _ in range(5):
        core.step()
    assert core.scheduler.block_manager.num_used_blocks == num_blocks

    before = half.stats_totals
    with consumer() as llm:
        results = pd_run(producer, llm, PROMPTS, [o.kv_transfer_params for o in outputs])
        received = scheduler_half(llm.engine).stats_totals
    assert [r.token_ids for r in results] == expected
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    sent = {k: v - before.get(k, 0.0) for k, v in half.stats_totals.items()}
    assert len(half.leases) == 0
    bytes_per_block = 4 * 2 * 2 * BLOCK_SIZE * 16 * 4  # layers x K/V x heads x tokens x dim x f32
    assert sent["num_sends"] == len(PROMPTS)
    assert sent["blocks_consumed"] == num_blocks
    assert sent["bytes_sent"] == num_blocks * bytes_per_block
    assert sent.get("num_leases_expired", 0) == 0
    assert received["num_handshakes"] == 1
    assert received["num_loads"] == len(PROMPTS)
    assert received["blocks_loaded"] == num_blocks
    assert received["bytes_received"] == num_blocks * bytes_per_block


def test_prefix_hit_on_the_consumer_pulls_only_the_missing_blocks(producer, expected, monkeypatch):
    with consumer() as llm:
        loads = []
        build = llm.engine.connector.build_connector_meta

        def spy(scheduler_output):
            metadata = build(scheduler_output)
            loads.extend(metadata.loads)
            return metadata

        monkeypatch.setattr(llm.engine.connector, "build_connector_meta", spy)
        first = pd_run(producer, llm, [PROMPTS[2]])
        again = pd_run(producer, llm, [PROMPTS[2]])
        assert llm.engine.scheduler.stats.num_prefix_cache_hit_tokens == 32
    assert first[0].token_ids == again[0].token_ids == expected[2]
    # 40 tokens: the second request finds blocks 0-3 cached and pulls only the fifth.
    assert [len(load.local_block_ids) for load in loads] == [5, 1]
    (run,) = loads[1].runs
    assert run.remote_block_ids == loads[1].remote.block_ids[0][4:]


def test_pulled_blocks_equal_the_producers_bytes_drafter_included():
    prompt = PROMPTS[3]
    (reference,) = colocated([prompt], speculative=DRAFT)
    producer = EngineCore(engine_config(kv_config("kv_producer", "p-draft"), speculative=DRAFT))
    decoder = EngineCore(engine_config(kv_config("kv_consumer", "d-draft"), speculative=DRAFT))
    try:
        producer.add_request("p", prompt, PREFILL, REMOTE_DECODE)
        params = None
        while params is None:
            params = next((o.kv_transfer_params for o in producer.step() if o.finished), None)
        # The step after the request finished grants its lease to the producer's workers.
        producer.step()
        decoder.add_request("d", prompt, DECODE, params)
        request = decoder.scheduler.get_request("d")
        step_until(
            decoder.step,
            lambda: request.status is RequestStatus.WAITING_WITH_KV,
            "the load finished",
            WAIT_S,
        )
        # Loaded, not yet run: the next step recomputes only the last prompt token.
        assert request.num_computed_tokens == len(prompt) - 1
        local = decoder.scheduler.block_manager.get_block_ids("d")[: blocks_of(prompt)]
        remote = params["remote_block_ids"]
        produced, pulled = worker_caches(producer), worker_caches(decoder)
        assert sorted(pulled) == [
            "draft.layers.0.self_attn",
            "draft.layers.1.self_attn",
            *(f"model.layers.{i}.self_attn" for i in range(4)),
        ]
        for name, cache in pulled.items():
            assert torch.equal(cache[local], produced[name][remote]), name
        assert produced["draft.layers.1.self_attn"][remote].abs().sum() > 0

        tokens, drafts, accepted = [], 0, 0
        while decoder.has_unfinished_requests():
            for output in decoder.step():
                tokens.extend(output.new_token_ids)
                drafts += output.num_draft_tokens
                accepted += output.num_accepted_tokens
        assert tokens == reference.token_ids
        assert drafts > 0
        assert (drafts, accepted) == (reference.num_draft_tokens, reference.num_accepted_tokens)
        finish(decoder, producer)
    finally:
        decoder.shutdown()
        producer.shutdown()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"remote_block_ids": None}, "kv_transfer_params.remote_block_ids is missing"),
        ({"remote_port": "80"}, "kv_transfer_params.remote_port must be a port in [1, 65535]"),
        ({"tp_size": 0}, "kv_transfer_params.tp_size must be an int >= 1, got 0"),
        ({"do_remote_prefill": "yes"}, "kv_transfer_params.do_remote_prefill must be a bool"),
    ],
)
def test_malformed_params_are_rejected_before_anything_is_held(producer, expected, change, message):
    (output,) = prefill(producer, [PROMPTS[3]])
    bad = {**output.kv_transfer_params, **change, "remote_request_id": "never-held"}
    bad = {k: v for k, v in bad.items() if v is not None}
    with consumer() as llm:
        with pytest.raises(ValueError, match=re.escape(f"request 'bad': {message}")):
            llm.engine.add_request("bad", PROMPTS[3], DECODE, bad)
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
        (good,) = pd_run(producer, llm, [PROMPTS[3]], [output.kv_transfer_params])
    assert good.token_ids == expected[3]


def test_a_prompt_other_than_the_one_prefilled_fails_that_request_only(producer, expected):
    outputs = prefill(producer, [PROMPTS[3], PROMPTS[3]])
    core = producer.engine
    other = list(PROMPTS[3])
    other[5] = (other[5] + 1) % 200
    with consumer() as llm:
        params = [o.kv_transfer_params for o in outputs]
        bad_result, good = pd_run(producer, llm, [other, PROMPTS[3]], params)
    assert bad_result.finish_reason == "error"
    assert bad_result.error.startswith(
        "KV connector UcxConnector.get_num_new_matched_tokens raised for request gen-0: "
        "ValueError: the prompt differs from the 70 prompt tokens engine 'prefill' computed "
        "(kv_transfer_params.remote_prompt_digest mismatch)"
    )
    assert good.token_ids == expected[3]
    assert core.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_incompatible_block_size_follows_the_policy(producer, expected, policy, caplog):
    (output,) = prefill(producer, [PROMPTS[3]])
    config = engine_config(kv_config("kv_consumer", f"d16-{policy}", policy), block_size=16)
    with (
        LLM(config) as llm,
        caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"),
    ):
        (result,) = pd_run(producer, llm, [PROMPTS[3]], [output.kv_transfer_params])
        failed = scheduler_half(llm.engine).stats_totals["num_loads_failed"]
    assert failed == 1
    assert "is incompatible with this engine: block_size: local=16 remote=8" in caplog.text
    if policy == "fail":
        assert (result.finish_reason, result.token_ids) == ("error", [])
        assert result.error.startswith(
            "KV load failed for request gen-0 (kv_load_failure_policy=fail): "
            "HandshakeCompatibilityError: "
        )
        assert "block_size: local=16 remote=8" in result.error
    else:
        assert result.token_ids == expected[3]


@pytest.mark.parametrize(
    ("change", "logged"),
    [
        ({"remote_engine_id": "ghost"}, "EngineIdMismatchError: expected engine 'ghost' at "),
        ({"remote_port": None}, "ProducerUnreachable: engine 'prefill-lease' at 127.0.0.1:"),
    ],
    ids=["unknown-engine-id", "unreachable"],
)
def test_unusable_producer_fails_the_load(short_lease_producer, expected, change, logged, caplog):
    (output,) = prefill(short_lease_producer, [PROMPTS[1]])
    if change.get("remote_port", 0) is None:
        change = {"remote_port": _closed_port()}
    params = {**output.kv_transfer_params, **change}
    with (
        consumer() as llm,
        caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"),
    ):
        (result,) = pd_run(short_lease_producer, llm, [PROMPTS[1]], [params])
    assert result.error.startswith(
        "KV load failed for request gen-0 (kv_load_failure_policy=fail): " + logged
    )
    assert logged in caplog.text


def test_lease_frees_blocks_nobody_pulls():
    with LLM(engine_config(kv_config("kv_producer", "leased", kv_lease_s=0.3))) as llm:
        prefill(llm, PROMPTS[:2])
        core = llm.engine
        assert core.scheduler.block_manager.num_used_blocks == blocks_of(PROMPTS[0]) + blocks_of(
            PROMPTS[1]
        )
        finish(core)
        totals = scheduler_half(core).stats_totals
    assert totals["num_leases_expired"] == 2
    assert "num_sends" not in totals


def test_consumer_admitted_after_the_lease_ran_out_does_not_decode_stale_kv(expected):
    with (
        LLM(engine_config(kv_config("kv_producer", "forgetful", kv_lease_s=0.2))) as producer,
        consumer(policy="recompute") as llm,
    ):
        (late,) = prefill(producer, [PROMPTS[3]])
        finish(producer.engine)
        # The producer may now reuse the blocks the late request's params point at.
        pd_run(producer, llm, PROMPTS[:3])
        (result,) = pd_run(producer, llm, [PROMPTS[3]], [late.kv_transfer_params])
        totals = scheduler_half(llm.engine).stats_totals
    assert result.token_ids == expected[3]
    assert totals["num_loads_failed"] == 1


def test_producer_aborted_mid_prompt_hands_over_what_it_computed(expected):
    config = engine_config(kv_config("kv_producer", "chunky"), max_num_batched_tokens=16)
    with LLM(config) as producer, consumer() as llm:
        core = producer.engine
        core.add_request("cut", PROMPTS[3], PREFILL, REMOTE_DECODE)
        core.step()
        core.step()
        (aborted,) = core.abort_request(["cut"])
        params = aborted.kv_transfer_params
        assert (params["remote_num_tokens"], len(params["remote_block_ids"])) == (32, 4)
        (result,) = pd_run(producer, llm, [PROMPTS[3]], [params])
        # 32 tokens came from the producer; the consumer computed the other 38 itself.
        assert llm.engine.scheduler.stats.num_prefix_cache_hit_tokens == 0
        received = scheduler_half(llm.engine).stats_totals["blocks_received"]
    assert aborted.finish_reason == "abort"
    assert received == 4
    assert result.token_ids == expected[3]


def _stalled_producer(engine_id: str, **extra) -> LLM:
    """A producer that answers handshakes but whose worker no longer serves pulls."""
    llm = LLM(engine_config(kv_config("kv_producer", engine_id, **extra)))
    worker_half(llm.engine).agent.server.stop()
    return llm


def test_keep_alives_hold_the_lease_through_a_slow_transfer(expected):
    with _stalled_producer("stalled", kv_lease_s=1.0) as producer:
        config = kv_config("kv_consumer", "patient", "recompute", transfer_timeout_s=3.0)
        with LLM(engine_config(config)) as llm:
            (result,) = pd_run(producer, llm, [PROMPTS[2]])
            failed = scheduler_half(llm.engine).stats_totals["num_loads_failed"]
        totals = scheduler_half(producer.engine).stats_totals
    # The pull timed out after three leases' time, and the consumer then recomputed.
    assert failed == 1
    assert result.token_ids == expected[2]
    assert totals["num_sends"] == 1
    assert "num_leases_expired" not in totals


def test_abort_during_transfer_keeps_blocks_until_the_pull_stopped():
    with _stalled_producer("stalled-abort") as producer:
        (output,) = prefill(producer, [PROMPTS[3]])
        core = EngineCore(engine_config(kv_config("kv_consumer", "aborter")))
        try:
            core.add_request("d", PROMPTS[3], DECODE, output.kv_transfer_params)
            core.step()
            assert core.scheduler.get_request("d").status is RequestStatus.WAITING_FOR_REMOTE_KVS
            half = worker_half(core)
            wait_until(lambda: half.load_job("d").num_pulls_started, "the pulls started", WAIT_S)
            used = core.scheduler.block_manager.num_used_blocks
            assert used == blocks_of(PROMPTS[3])
            (aborted,) = core.abort_request(["d"])
            assert aborted.finish_reason == "abort"
            assert core.scheduler.block_manager.num_used_blocks == used
            # This step tells the worker, which stops the pulls without waiting; the load is
            # reported (and the blocks freed) once they stopped.
            step_until(
                core.step,
                lambda: core.scheduler.block_manager.num_used_blocks == 0,
                "the aborted load's blocks freed",
            )
            assert half.load_job("d") is None
            finish(core)
        finally:
            core.shutdown()
        finish(producer.engine)
        totals = scheduler_half(producer.engine).stats_totals
    assert totals["num_sends"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_producer_gone_before_the_pull(expected, policy):
    with LLM(engine_config(kv_config("kv_producer", "gone", kv_lease_s=0.2))) as producer:
        (output,) = prefill(producer, [PROMPTS[2]])
        finish(producer.engine)
    with consumer(policy=policy, handshake_timeout_s=0.5) as llm:
        (result,) = llm.generate([PROMPTS[2]], DECODE, [output.kv_transfer_params])
        finish(llm.engine)
    if policy == "fail":
        assert result.error.startswith(
            "KV load failed for request gen-0 (kv_load_failure_policy=fail): "
        )
    else:
        assert result.token_ids == expected[2]


def test_producer_gone_after_the_handshake_times_the_pull_out(expected, caplog):
    producer = LLM(engine_config(kv_config("kv_producer", "vanishing")))
    with consumer(policy="recompute", transfer_timeout_s=1.0) as llm:
        try:
            pd_run(producer, llm, [PROMPTS[1]])
            (output,) = prefill(producer, [PROMPTS[2]])
        finally:
            producer.shutdown()
        assert len(worker_half(llm.engine).remote_engines) == 1
        with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
            (result,) = llm.generate([PROMPTS[2]], DECODE, [output.kv_transfer_params])
        finish(llm.engine)
        assert worker_half(llm.engine).remote_engines == []
    assert result.token_ids == expected[2]
    assert "loading KV of request gen-1 from engine vanishing failed" in caplog.text


def test_restarted_producer_is_handshaken_again(expected, caplog):
    port = _closed_port()

    def start() -> LLM:
        config = KVTransferConfig(
            kv_connector="UcxConnector",
            kv_role="kv_producer",
            engine_id="phoenix",
            kv_port=port,
            kv_connector_extra_config={"kv_lease_s": 0.3},
        )
        return LLM(engine_config(config))

    with consumer() as llm:
        with start() as first:
            pd_run(first, llm, [PROMPTS[0]])
            (stale,) = prefill(first, [PROMPTS[1]])
            finish(first.engine)  # the lease frees the unpulled request
        with start() as second:
            assert scheduler_half(second.engine).address == f"127.0.0.1:{port}"
            results = pd_run(second, llm, [PROMPTS[2]])
            with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
                (refused,) = pd_run(second, llm, [PROMPTS[1]], [stale.kv_transfer_params])
        handshakes = scheduler_half(llm.engine).stats_totals["num_handshakes"]
    assert results[0].token_ids == expected[2]
    assert refused.error.startswith(
        "KV load failed for request gen-2 (kv_load_failure_policy=fail): StaleGenerationError: "
        "engine 'phoenix' at 127.0.0.1:"
    )
    assert "StaleGenerationError: engine 'phoenix' at 127.0.0.1:" in caplog.text
    assert handshakes == 3


def test_multi_connector_with_ucx_and_shared_storage_children(tmp_path, expected):
    def multi(role: str, engine_id: str) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": "UcxConnector"},
                    {
                        "kv_connector": "SharedStorageConnector",
                        "kv_role": "kv_consumer",
                        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
                    },
                ]
            },
        )

    with (
        LLM(engine_config(multi("kv_producer", "multi-p"))) as producer,
        LLM(engine_config(multi("kv_consumer", "multi-d"))) as llm,
    ):
        results = pd_run(producer, llm, PROMPTS)
        (ucx_child, _) = llm.engine.connector.connectors
        totals = ucx_child.scheduler_half.stats_totals
    assert [r.token_ids for r in results] == expected
    # Each child sees its own stats, not the Multi's (keys are the child's own).
    assert totals["num_loads"] == len(PROMPTS)
    assert list(tmp_path.iterdir()) == []


def test_stepping_producer_frees_blocks_while_the_consumer_runs(producer, expected):
    outputs = prefill(producer, PROMPTS[:2])
    core = producer.engine
    with consumer() as llm, stepping(core):
        results = llm.generate(PROMPTS[:2], DECODE, [o.kv_transfer_params for o in outputs])
        wait_until(lambda: not scheduler_half(core).leases, "the producer's leases ended", WAIT_S)
        finish(llm.engine)
    assert len(scheduler_half(core).leases) == 0
    finish(core)
    assert [r.token_ids for r in results] == expected[:2]


@pytest.mark.parametrize(
    ("blocks", "error", "logged"),
    [
        (
            [0],
            "KV connector UcxConnector.get_num_new_matched_tokens raised for request gen-0: "
            "ValueError: kv_transfer_params.remote_block_ids holds 1 blocks, remote_num_tokens "
            "70 needs 9 of 8 tokens",
            "",
        ),
        (
            list(range(100000)),
            "KV load failed for request gen-0 (kv_load_failure_policy=fail): RemoteLayoutError: "
            "kv_transfer_params.remote_block_ids holds 100000 blocks",
            "RemoteLayoutError: kv_transfer_params.remote_block_ids holds 100000 blocks, "
            "remote_num_tokens 70 needs exactly 9 of engine 'prefill''s 8-token blocks",
        ),
    ],
    ids=["too-few", "too-many"],
)
def test_block_lists_that_do_not_fit_fail_that_request_only(
    producer, expected, blocks, error, logged, caplog
):
    (output,) = prefill(producer, [PROMPTS[3]])
    bad = {**output.kv_transfer_params, "remote_block_ids": blocks}
    (spare,) = prefill(producer, [PROMPTS[3]])
    with (
        consumer() as llm,
        caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"),
    ):
        params = [bad, spare.kv_transfer_params]
        bad_result, good = pd_run(producer, llm, [PROMPTS[3], PROMPTS[3]], params)
    assert bad_result.finish_reason == "error"
    assert bad_result.error.startswith(error)
    assert logged in caplog.text
    assert bad_result.token_ids == []
    assert good.token_ids == expected[3]
