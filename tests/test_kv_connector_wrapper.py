"""The model runner's connector wrapper: the null object, the hook order of forward and
no-forward steps, and what ends up in the step's `KVConnectorOutput`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtransfer.connector.base import TransferResults
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVConnectorMetadata, KVConnectorRole, KVConnectorStats
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.engine.model.forward_context import AttentionMetadata
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from kvtransfer.engine.runner.kv_connector import ActiveKVConnector, KVConnector, make_kv_connector
from kvtransfer.engine.scheduler_output import SchedulerOutput
from kvtransfer.testing.recording import RecordingConnector, RecordingHandshakeMetadata

pytestmark = pytest.mark.unit

CONFIG = KVTransferConfig(
    kv_connector="RecordingConnector",
    kv_connector_module_path="kvtransfer.testing.recording",
    kv_role="kv_both",
    engine_id="engine-a",
)
LAYERS = ("layers.0.self_attn", "layers.1.self_attn", "draft.layers.0.self_attn")


def _attn_metadata() -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([1]),
        block_tables=torch.tensor([[0]]),
        block_size=4,
    )


def _active(connector_cls: type[RecordingConnector] = RecordingConnector) -> ActiveKVConnector:
    return ActiveKVConnector(connector_cls(CONFIG, KVConnectorRole.WORKER))


def _recording(wrapper: ActiveKVConnector) -> RecordingConnector:
    connector = wrapper.connector
    assert isinstance(connector, RecordingConnector)
    return connector


class ReportingConnector(RecordingConnector):
    """Reports fixed transfer results, load errors and stats once, like a real connector."""

    def __init__(self, config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(config, role, kv_cache_config)
        self.results: TransferResults = ({"sent"}, {"got"}, {"lost"})
        self.invalid: set[int] = {3, 4}
        self.stats: KVConnectorStats | None = KVConnectorStats(data={"bytes": 10})
        self.seen_finished: list[Any] = []

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        self.seen_finished.append(finished_req_ids)
        self._record("get_transfer_results")
        return self.results

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors")
        return self.invalid

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        self._record("get_kv_connector_stats")
        return self.stats


class FailingSaveConnector(RecordingConnector):
    def wait_for_save(self) -> None:
        super().wait_for_save()
        raise RuntimeError("save transport down")


class FailingResultsConnector(RecordingConnector):
    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        raise RuntimeError("results unavailable")


class MetadataSpyConnector(RecordingConnector):
    """Remembers what was bound when loading started, and how start_load_kv was called."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        self.load_args = (forward_context, kwargs, self._get_connector_metadata())


# ---------------------------------------------------------------------------- null object


def test_null_connector_does_nothing_and_reports_nothing():
    null = KVConnector()
    output = SchedulerOutput(finished_req_ids=frozenset({"a"}))
    assert null.register_kv_caches({"layers.0.self_attn": torch.zeros(1)}) is None
    assert null.handshake_metadata() is None
    assert null.pre_forward(output) is None
    assert null.before_attention("layers.0.self_attn") is None
    assert null.after_attention("layers.0.self_attn", torch.zeros(1), _attn_metadata()) is None
    assert null.post_forward(frozenset({"a"})) is None
    assert null.post_forward({"a"}, wait_for_save=False) is None
    assert null.no_forward(output) is EMPTY_MODEL_RUNNER_OUTPUT
    assert null.shutdown() is None


@pytest.mark.parametrize("config", [None, KVTransferConfig()])
def test_make_kv_connector_without_a_connector_gives_the_null_object(config):
    assert type(make_kv_connector(config)) is KVConnector


def test_make_kv_connector_wraps_a_worker_instance_of_the_configured_connector():
    wrapper = make_kv_connector(CONFIG)
    assert type(wrapper) is ActiveKVConnector
    connector = _recording(wrapper)
    assert connector.role == KVConnectorRole.WORKER
    assert connector.kv_transfer_config is CONFIG


def test_active_wrapper_rejects_a_scheduler_instance():
    with pytest.raises(
        ValueError,
        match=r"ActiveKVConnector needs a WORKER-role connector, got SCHEDULER "
        r"\(RecordingConnector\)",
    ):
        ActiveKVConnector(RecordingConnector(CONFIG, KVConnectorRole.SCHEDULER))


# ------------------------------------------------------------------------------ hook order


def test_forward_step_calls_hooks_in_order():
    wrapper = _active()
    connector = _recording(wrapper)
    wrapper.register_kv_caches({name: torch.zeros(2, 2, 1, 4, 8) for name in LAYERS})
    assert wrapper.handshake_metadata() == RecordingHandshakeMetadata(
        engine_id="engine-a", layer_names=LAYERS
    )
    wrapper.pre_forward(SchedulerOutput(finished_req_ids=frozenset({"r1"})))
    cache = torch.zeros(2, 2, 1, 4, 8)
    for layer in LAYERS:
        wrapper.before_attention(layer)
        wrapper.after_attention(layer, cache, _attn_metadata())
    assert wrapper.post_forward(frozenset({"r1"})) is None
    wrapper.shutdown()
    assert connector.calls == [
        ("register_kv_caches", LAYERS),
        ("bind_connector_metadata", None),
        ("start_load_kv", None),
        ("wait_for_layer_load", "layers.0.self_attn"),
        ("save_kv_layer", "layers.0.self_attn"),
        ("wait_for_layer_load", "layers.1.self_attn"),
        ("save_kv_layer", "layers.1.self_attn"),
        ("wait_for_layer_load", "draft.layers.0.self_attn"),
        ("save_kv_layer", "draft.layers.0.self_attn"),
        ("wait_for_save", None),
        ("get_finished", frozenset({"r1"})),
        ("clear_connector_metadata", None),
        ("shutdown", None),
    ]
    assert not connector.has_connector_metadata()


def test_no_forward_step_binds_loads_reports_and_clears_without_waiting_for_save():
    wrapper = _active()
    result = wrapper.no_forward(SchedulerOutput(finished_req_ids=frozenset({"r1", "r2"})))
    assert result is EMPTY_MODEL_RUNNER_OUTPUT
    assert _recording(wrapper).calls == [
        ("bind_connector_metadata", None),
        ("start_load_kv", None),
        ("get_finished", frozenset({"r1", "r2"})),
        ("clear_connector_metadata", None),
    ]


def test_post_forward_can_skip_wait_for_save():
    wrapper = _active()
    wrapper.pre_forward(SchedulerOutput())
    wrapper.post_forward(set(), wait_for_save=False)
    assert "wait_for_save" not in _recording(wrapper).hooks_called()


def test_pre_forward_binds_the_schedulers_metadata_and_loads_without_forward_context():
    wrapper = _active(MetadataSpyConnector)
    metadata = KVConnectorMetadata()
    wrapper.pre_forward(SchedulerOutput(kv_connector_metadata=metadata))
    connector = wrapper.connector
    assert isinstance(connector, MetadataSpyConnector)
    forward_context, kwargs, bound = connector.load_args
    assert (forward_context, kwargs) == (None, {})
    assert bound is metadata


def test_pre_forward_binds_empty_metadata_when_the_scheduler_built_none():
    wrapper = _active(MetadataSpyConnector)
    wrapper.pre_forward(SchedulerOutput())
    connector = wrapper.connector
    assert isinstance(connector, MetadataSpyConnector)
    assert type(connector.load_args[2]) is KVConnectorMetadata


# ------------------------------------------------------------------------- failure handling


def test_metadata_is_cleared_even_when_wait_for_save_raises():
    wrapper = _active(FailingSaveConnector)
    wrapper.pre_forward(SchedulerOutput())
    with pytest.raises(RuntimeError, match="save transport down"):
        wrapper.post_forward(frozenset())
    connector = _recording(wrapper)
    assert connector.hooks_called() == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "clear_connector_metadata",
    ]
    assert not connector.has_connector_metadata()


def test_metadata_is_cleared_even_when_collecting_results_raises():
    wrapper = _active(FailingResultsConnector)
    with pytest.raises(RuntimeError, match="results unavailable"):
        wrapper.no_forward(SchedulerOutput())
    connector = _recording(wrapper)
    assert connector.hooks_called()[-1] == "clear_connector_metadata"
    assert not connector.has_connector_metadata()


# --------------------------------------------------------------------------- step results


def test_post_forward_reports_results_with_failed_receives_also_finished():
    wrapper = _active(ReportingConnector)
    wrapper.pre_forward(SchedulerOutput())
    output = wrapper.post_forward(frozenset({"done"}))
    assert output == KVConnectorOutput(
        finished_sending={"sent"},
        finished_recving={"got", "lost"},
        failed_recving={"lost"},
        invalid_block_ids={3, 4},
        kv_connector_stats=KVConnectorStats(data={"bytes": 10}),
    )
    connector = wrapper.connector
    assert isinstance(connector, ReportingConnector)
    # The connector gets a plain set it may consume, not the scheduler's frozenset.
    assert connector.seen_finished == [{"done"}]
    assert type(connector.seen_finished[0]) is set
    assert connector.hooks_called()[-5:] == [
        "wait_for_save",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "clear_connector_metadata",
    ]


def test_failed_receive_not_reported_as_finished_is_added_to_finished():
    wrapper = _active(ReportingConnector)
    connector = wrapper.connector
    assert isinstance(connector, ReportingConnector)
    connector.results = (None, None, {"lost"})
    connector.invalid = set()
    connector.stats = None
    wrapper.pre_forward(SchedulerOutput())
    assert wrapper.post_forward(frozenset()) == KVConnectorOutput(
        finished_recving={"lost"}, failed_recving={"lost"}
    )


def test_post_forward_returns_none_when_nothing_happened():
    wrapper = _active(ReportingConnector)
    connector = wrapper.connector
    assert isinstance(connector, ReportingConnector)
    connector.results = (set(), None, set())
    connector.invalid = set()
    connector.stats = KVConnectorStats()
    wrapper.pre_forward(SchedulerOutput())
    assert wrapper.post_forward(frozenset()) is None


def test_empty_stats_are_dropped_from_a_non_empty_output():
    wrapper = _active(ReportingConnector)
    connector = wrapper.connector
    assert isinstance(connector, ReportingConnector)
    connector.results = ({"sent"}, None, None)
    connector.invalid = set()
    connector.stats = KVConnectorStats()
    wrapper.pre_forward(SchedulerOutput())
    assert wrapper.post_forward(frozenset()) == KVConnectorOutput(finished_sending={"sent"})


def test_no_forward_with_results_returns_a_copy_and_leaves_the_empty_output_alone():
    wrapper = _active(ReportingConnector)
    result = wrapper.no_forward(SchedulerOutput(finished_req_ids=frozenset({"x"})))
    assert result is not EMPTY_MODEL_RUNNER_OUTPUT
    assert result == ModelRunnerOutput(
        kv_connector_output=KVConnectorOutput(
            finished_sending={"sent"},
            finished_recving={"got", "lost"},
            failed_recving={"lost"},
            invalid_block_ids={3, 4},
            kv_connector_stats=KVConnectorStats(data={"bytes": 10}),
        )
    )
    assert ModelRunnerOutput() == EMPTY_MODEL_RUNNER_OUTPUT
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
    connector = wrapper.connector
    assert isinstance(connector, ReportingConnector)
    assert "wait_for_save" not in connector.hooks_called()
    assert connector.seen_finished == [{"x"}]
