from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtransfer import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    IntermediateTensors,
    KVConnectorOutput,
    KVConnectorStats,
    ModelRunnerOutput,
)

pytestmark = pytest.mark.unit


def _snapshot(output: ModelRunnerOutput) -> dict:
    return {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}


EMPTY_STATE = _snapshot(EMPTY_MODEL_RUNNER_OUTPUT)


@pytest.fixture(autouse=True)
def _singleton_untouched():
    yield
    assert _snapshot(EMPTY_MODEL_RUNNER_OUTPUT) == EMPTY_STATE
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None


def test_connector_output_built_with_keywords_all_defaulted():
    out = KVConnectorOutput()
    assert out.finished_sending is None and out.finished_recving is None
    assert out.failed_recving is None and out.invalid_block_ids is None
    assert out.kv_connector_stats is None and out.expected_finished_count == 0
    assert out.is_empty()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"finished_sending": {"a"}},
        {"finished_recving": {"a"}},
        {"failed_recving": {"a"}},
        {"invalid_block_ids": {3}},
        {"kv_connector_stats": KVConnectorStats(data={"bytes": 1})},
        {"expected_finished_count": 2},
    ],
)
def test_any_field_makes_output_non_empty(kwargs):
    assert not KVConnectorOutput(**kwargs).is_empty()


def test_empty_containers_and_empty_stats_count_as_empty():
    out = KVConnectorOutput(
        finished_sending=set(), invalid_block_ids=set(), kv_connector_stats=KVConnectorStats()
    )
    assert out.is_empty()


@pytest.mark.parametrize(
    "value", [None, KVConnectorOutput(), KVConnectorOutput(finished_sending=set())]
)
def test_with_kv_conn_output_only_returns_the_singleton_for_nothing(value):
    assert ModelRunnerOutput.with_kv_conn_output_only(value) is EMPTY_MODEL_RUNNER_OUTPUT


def test_with_kv_conn_output_only_copies_for_something():
    kv = KVConnectorOutput(finished_recving={"r1"})
    out = ModelRunnerOutput.with_kv_conn_output_only(kv)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert out.kv_connector_output is kv
    assert out.req_ids == () and out.sampled_token_ids == () and dict(out.req_id_to_index) == {}


def test_copies_cannot_reach_the_singleton_containers():
    out = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending={"s"}))
    with pytest.raises((TypeError, AttributeError)):
        out.req_id_to_index["x"] = 0  # type: ignore[index]
    with pytest.raises(AttributeError):
        out.req_ids.append("x")  # type: ignore[attr-defined]


def _tensors() -> IntermediateTensors:
    return IntermediateTensors(
        {
            "hidden_states": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "residual": torch.ones(4, 3, dtype=torch.bfloat16),
            "positions_aux": torch.arange(4, dtype=torch.int64),
        }
    )


def test_empty_like_keeps_every_field():
    src = _tensors()
    empty = IntermediateTensors.empty_like(src)
    assert list(empty) == list(src)
    for name, tensor in src.items():
        assert empty[name].shape == tensor.shape
        assert empty[name].dtype == tensor.dtype
        assert empty[name].device == tensor.device
        assert empty[name].data_ptr() != tensor.data_ptr()


def test_slicing_keeps_every_field():
    src = _tensors()
    head = src[:2]
    assert isinstance(head, IntermediateTensors)
    assert list(head) == list(src)
    assert torch.equal(head["hidden_states"], src["hidden_states"][:2])
    assert len(head) == 3


def test_tensors_only():
    src = _tensors()
    assert not hasattr(src, "kv_connector_output")
    with pytest.raises(AttributeError):
        src.kv_connector_output = KVConnectorOutput()  # type: ignore[attr-defined]


def test_equality_and_set():
    a, b = _tensors(), _tensors()
    assert a == b
    b["hidden_states"] = torch.zeros(4, 3)
    assert a != b
    assert a != IntermediateTensors({"hidden_states": a["hidden_states"]})
    with pytest.raises(TypeError):
        a[0]  # type: ignore[index]
