from __future__ import annotations

import dataclasses

import pytest

from kvtransfer import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorBase_V1,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVOutputAggregator,
    KVTransferConfig,
    ModelRunnerOutput,
)

EMPTY_STATE = {
    f.name: getattr(EMPTY_MODEL_RUNNER_OUTPUT, f.name)
    for f in dataclasses.fields(ModelRunnerOutput)
}


@pytest.fixture(autouse=True)
def _singleton_untouched():
    yield
    state = {
        f.name: getattr(EMPTY_MODEL_RUNNER_OUTPUT, f.name)
        for f in dataclasses.fields(ModelRunnerOutput)
    }
    assert state == EMPTY_STATE


def out(**kv) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=("x",), kv_connector_output=KVConnectorOutput(**kv))


def kv(result: ModelRunnerOutput | None) -> KVConnectorOutput:
    assert result is not None and result.kv_connector_output is not None
    return result.kv_connector_output


def test_finished_only_when_every_worker_reported_across_steps():
    agg = KVOutputAggregator(3)
    r = agg.aggregate([out(finished_sending={"a"}), out(), out(finished_recving={"b"})])
    assert r is not None and r.kv_connector_output is None
    r = agg.aggregate([out(), out(finished_sending={"a"}), out(finished_recving={"b"})])
    assert r.kv_connector_output is None  # worker 2 repeating itself does not count twice
    r = agg.aggregate([out(finished_recving={"b"}), out(), out(finished_sending={"a"})])
    assert kv(r).finished_sending == {"a"} and kv(r).finished_recving is None
    r = agg.aggregate([out(), out(finished_recving={"b"}), out()])
    assert kv(r).finished_recving == {"b"} and kv(r).finished_sending is None
    assert agg.num_pending() == 0


def test_returns_the_output_rank_worker_output_without_mutating_it():
    agg = KVOutputAggregator(2)
    w0 = ModelRunnerOutput(
        req_ids=("w0",), kv_connector_output=KVConnectorOutput(finished_sending={"a"})
    )
    w1 = ModelRunnerOutput(
        req_ids=("w1",), kv_connector_output=KVConnectorOutput(finished_sending={"a"})
    )
    r = agg.aggregate([w0, w1], output_rank=1)
    assert r is not w1 and r.req_ids == ("w1",)
    assert kv(r).finished_sending == {"a"}
    assert w1.kv_connector_output.finished_sending == {"a"} and w1.kv_connector_output is not kv(r)


def test_invalid_block_ids_are_unioned_and_stats_aggregated():
    agg = KVOutputAggregator(2)
    r = agg.aggregate(
        [
            out(invalid_block_ids={1, 2}, kv_connector_stats=KVConnectorStats(data={"bytes": 10})),
            out(invalid_block_ids={2, 7}, kv_connector_stats=KVConnectorStats(data={"bytes": 5})),
        ]
    )
    assert kv(r).invalid_block_ids == {1, 2, 7}
    assert kv(r).kv_connector_stats.data == {"bytes": 15}


def test_failed_recving_surfaces_only_when_finished_on_all_workers():
    agg = KVOutputAggregator(2)
    r = agg.aggregate([out(finished_recving={"f"}, failed_recving={"f"}), out()])
    assert r.kv_connector_output is None
    r = agg.aggregate([out(), out(finished_recving={"f"})])
    assert kv(r).finished_recving == {"f"} and kv(r).failed_recving == {"f"}
    r = agg.aggregate([out(finished_recving={"ok"}), out(finished_recving={"ok"})])
    assert kv(r).failed_recving is None


def test_failed_without_finished_still_counts_as_finished():
    agg = KVOutputAggregator(1)
    r = agg.aggregate([out(failed_recving={"f"})])
    assert kv(r).finished_recving == {"f"} and kv(r).failed_recving == {"f"}


def test_expected_count_change_applies_only_to_new_counters():
    agg = KVOutputAggregator(2)
    agg.aggregate([out(finished_sending={"old"}), out()])
    r = agg.aggregate([out(expected_finished_count=1, finished_sending={"new"}), out()])
    assert kv(r).finished_sending == {"new"}  # created after the change: 1 report is enough
    r = agg.aggregate([out(finished_sending={"old"}), out()])
    assert r.kv_connector_output is None  # still needs its original 2 workers
    r = agg.aggregate([out(), out(finished_sending={"old"})])
    assert kv(r).finished_sending == {"old"}
    assert agg.expected_finished_count == 1


def test_empty_singleton_from_workers_is_never_mutated():
    agg = KVOutputAggregator(2)
    shared_kv = ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(finished_sending={"a"})
    )
    r = agg.aggregate([EMPTY_MODEL_RUNNER_OUTPUT, shared_kv])
    assert r is EMPTY_MODEL_RUNNER_OUTPUT  # nothing finished yet, nothing to carry
    r = agg.aggregate([EMPTY_MODEL_RUNNER_OUTPUT, EMPTY_MODEL_RUNNER_OUTPUT])
    assert r is EMPTY_MODEL_RUNNER_OUTPUT
    r = agg.aggregate([shared_kv, EMPTY_MODEL_RUNNER_OUTPUT])
    assert r is not EMPTY_MODEL_RUNNER_OUTPUT and kv(r).finished_sending == {"a"}


def test_none_outputs():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([None, None]) is None
    assert agg.aggregate([None, EMPTY_MODEL_RUNNER_OUTPUT]) is EMPTY_MODEL_RUNNER_OUTPUT
    r = agg.aggregate([None, out(finished_recving={"a"})])
    assert r.kv_connector_output is None
    r = agg.aggregate([out(finished_recving={"a"}), None], output_rank=1)
    assert kv(r).finished_recving == {"a"} and r.req_ids == ()


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected_finished_count must be >= 1"):
        KVOutputAggregator(0)
    with pytest.raises(ValueError, match="output_rank 2 out of range for 2 outputs"):
        KVOutputAggregator(1).aggregate([None, None], output_rank=2)


def test_from_connector_uses_finished_count_or_world_size():
    class Partial(KVConnectorBase_V1):
        def get_finished_count(self):
            return 2

    config = KVTransferConfig()
    assert (
        KVOutputAggregator.from_connector(
            Partial(config, KVConnectorRole.SCHEDULER), 8
        ).expected_finished_count
        == 2
    )
    plain = KVConnectorBase_V1(config, KVConnectorRole.SCHEDULER)
    assert KVOutputAggregator.from_connector(plain, 8).expected_finished_count == 8


def test_a_failure_reason_waits_for_every_worker_and_leaves_with_the_failure():
    agg = KVOutputAggregator(2)
    first = agg.aggregate(
        [
            out(
                finished_recving={"a"},
                failed_recving={"a"},
                load_failure_reasons={"a": "ProducerUnreachable: gone"},
            ),
            None,
        ]
    )
    assert first is not None and first.kv_connector_output is None
    second = kv(agg.aggregate([None, out(finished_recving={"a"}, failed_recving={"a"})]))
    assert second.failed_recving == {"a"}
    assert second.load_failure_reasons == {"a": "ProducerUnreachable: gone"}
    # Reported once: a later failure of the same id starts without it.
    agg.aggregate([out(finished_recving={"a"}, failed_recving={"a"}), None])
    third = kv(agg.aggregate([None, out(finished_recving={"a"}, failed_recving={"a"})]))
    assert third.load_failure_reasons is None
