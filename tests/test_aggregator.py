"""`KVOutputAggregator` (the connector contract: a transfer is finished once every worker
reported it) and `step_output` (the engine: the sampling worker's output carrying the merge)."""

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
from kvtransfer.engine.outputs import step_output

pytestmark = pytest.mark.unit

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


def out(**kv) -> KVConnectorOutput:
    return KVConnectorOutput(**kv)


def kv(result: KVConnectorOutput | None) -> KVConnectorOutput:
    assert result is not None
    return result


def test_finished_only_when_every_worker_reported_across_steps():
    agg = KVOutputAggregator(3)
    r = agg.aggregate([out(finished_sending={"a"}), out(), out(finished_recving={"b"})])
    assert r is None
    r = agg.aggregate([out(), out(finished_sending={"a"}), out(finished_recving={"b"})])
    assert r is None  # worker 2 repeating itself does not count twice
    r = agg.aggregate([out(finished_recving={"b"}), out(), out(finished_sending={"a"})])
    assert kv(r).finished_sending == {"a"} and kv(r).finished_recving is None
    r = agg.aggregate([out(), out(finished_recving={"b"}), out()])
    assert kv(r).finished_recving == {"b"} and kv(r).finished_sending is None
    assert agg.num_pending() == 0


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
    assert r is None
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
    assert r is None  # still needs its original 2 workers
    r = agg.aggregate([out(), out(finished_sending={"old"})])
    assert kv(r).finished_sending == {"old"}
    assert agg.expected_finished_count == 1


def test_inputs_are_not_mutated():
    agg = KVOutputAggregator(2)
    w0, w1 = out(finished_sending={"a"}), out(finished_sending={"a"})
    r = agg.aggregate([w0, w1])
    assert kv(r).finished_sending == {"a"} and r is not w0 and r is not w1
    assert w0.finished_sending == {"a"} and w1.finished_sending == {"a"}


def test_none_outputs():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([None, None]) is None
    assert agg.aggregate([None, out(finished_recving={"a"})]) is None
    assert kv(agg.aggregate([out(finished_recving={"a"}), None])).finished_recving == {"a"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected_finished_count must be >= 1"):
        KVOutputAggregator(0)
    with pytest.raises(ValueError, match="output_rank 2 out of range for 2 outputs"):
        step_output([None, None], 2, None)


def worker(name: str, **kv_fields) -> ModelRunnerOutput:
    kv_out = KVConnectorOutput(**kv_fields) if kv_fields else None
    return ModelRunnerOutput(req_ids=(name,), kv_connector_output=kv_out)


def test_step_output_is_the_sampling_workers_with_the_merge_and_leaves_it_untouched():
    w0, w1 = worker("w0", finished_sending={"a"}), worker("w1", finished_sending={"a"})
    merged = KVConnectorOutput(finished_sending={"a"})
    r = step_output([w0, w1], 1, merged)
    assert r is not w1 and r.req_ids == ("w1",) and r.kv_connector_output is merged
    assert w1.kv_connector_output.finished_sending == {"a"}
    # A worker's own not-yet-finished report is dropped: only the merge counts.
    r = step_output([w0, w1], 0, None)
    assert r.req_ids == ("w0",) and r.kv_connector_output is None
    assert w0.kv_connector_output is not None


def test_step_output_never_mutates_the_empty_singleton():
    shared_kv = ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(finished_sending={"a"})
    )
    assert step_output([EMPTY_MODEL_RUNNER_OUTPUT, shared_kv], 0, None) is (
        EMPTY_MODEL_RUNNER_OUTPUT
    )
    r = step_output([shared_kv, EMPTY_MODEL_RUNNER_OUTPUT], 1, out(finished_sending={"a"}))
    assert r is not EMPTY_MODEL_RUNNER_OUTPUT and kv(r.kv_connector_output).finished_sending == {
        "a"
    }


def test_step_output_without_worker_outputs():
    assert step_output([None, None], 0, None) is None
    assert step_output([None, EMPTY_MODEL_RUNNER_OUTPUT], 0, None) is EMPTY_MODEL_RUNNER_OUTPUT
    r = step_output([None, worker("w1")], 0, out(finished_recving={"a"}))
    assert r.req_ids == () and kv(r.kv_connector_output).finished_recving == {"a"}


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
    assert first is None
    second = kv(agg.aggregate([None, out(finished_recving={"a"}, failed_recving={"a"})]))
    assert second.failed_recving == {"a"}
    assert second.load_failure_reasons == {"a": "ProducerUnreachable: gone"}
    # Reported once: a later failure of the same id starts without it.
    agg.aggregate([out(finished_recving={"a"}, failed_recving={"a"}), None])
    third = kv(agg.aggregate([None, out(finished_recving={"a"}, failed_recving={"a"})]))
    assert third.load_failure_reasons is None


def test_outputs_of_a_failed_step_are_counted_at_the_next_aggregate():
    # vLLM 0.33's ft_defer_kv_connector_outputs: worker 1 failed the step; what workers 0 and
    # 2 reported in it (a send done, a failed load with its blocks) must not be lost.
    agg = KVOutputAggregator(3)
    agg.defer(
        [
            out(finished_sending={"s"}, failed_recving={"l"}, invalid_block_ids={4}),
            None,
            out(finished_sending={"s"}, finished_recving={"l"}, failed_recving={"l"}),
        ]
    )
    assert agg.num_pending() == 1
    merged = kv(
        agg.aggregate(
            [None, out(finished_sending={"s"}, finished_recving={"l"}, failed_recving={"l"}), None]
        )
    )
    assert merged.finished_sending == {"s"}
    assert (merged.finished_recving, merged.failed_recving) == ({"l"}, {"l"})
    assert merged.invalid_block_ids == {4}
    assert agg.num_pending() == 0
    # A deferred report counts for its own worker only: worker 0 twice is still one worker.
    agg.defer([out(finished_sending={"t"}), None, None])
    assert agg.aggregate([out(finished_sending={"t"}), None, None]) is None
    assert agg.num_pending() == 1
