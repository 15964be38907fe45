"""A non-last pipeline rank's model runner: sends activations on and reports only connector
output (vLLM PR #43732). Tested on one layer in isolation: the next stage is a recording stub."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.engine.model.builtin import builtin_model_config, builtin_weights
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    IntermediateTensors,
    ModelRunnerOutput,
)
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.runner.kv_connector import ActiveKVConnector, KVConnector
from kvtransfer.engine.runner.model_runner import ModelRunner
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler_output import NewRequestData, SchedulerOutput

pytestmark = pytest.mark.unit


class NextStage:
    def __init__(self) -> None:
        self.sent: list[tuple[IntermediateTensors, int]] = []

    def tp_broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def pp_send(self, tensors: IntermediateTensors, dst_pp_rank: int) -> None:
        self.sent.append((tensors, dst_pp_rank))

    def pp_recv(self, template: IntermediateTensors, src_pp_rank: int) -> IntermediateTensors:
        raise AssertionError("the first stage never receives")


class ReportsSends(KVConnectorBase_V1):
    def get_finished(self, finished_req_ids):
        return set(finished_req_ids) or None, None


def first_stage_runner(kv_connector: KVConnector) -> tuple[ModelRunner, NextStage]:
    config = builtin_model_config("tiny")
    model = LlamaForCausalLM(config, ParallelRank(pp_rank=0, pp_size=2))
    model.load_weights(builtin_weights("tiny").items())
    caches = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in model.layer_names()]
    stage = NextStage()
    runner = ModelRunner(
        model, caches, kv_connector, stage, block_size=4, pp_rank=0, pp_size=2,
        proposer=None, device=torch.device("cpu"),
    )  # fmt: skip
    return runner, stage


def step(finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    new = NewRequestData(
        req_id="r0",
        prompt_len=6,
        token_ids=(1, 2, 3, 4, 5, 6),
        sampling_params=SamplingParams(),
        seed=0,
        block_ids=(3, 5),
        num_computed_tokens=0,
    )
    return SchedulerOutput(
        scheduled_new_reqs=(new,), num_scheduled_tokens={"r0": 6}, finished_req_ids=finished
    )


def test_non_last_rank_without_connector_output_returns_the_shared_empty_output():
    runner, stage = first_stage_runner(KVConnector())
    output = runner.execute_model(step())
    assert output is EMPTY_MODEL_RUNNER_OUTPUT
    (sent, dst) = stage.sent[0]
    assert dst == 1
    assert sorted(sent.tensors) == ["hidden_states", "residual"]
    assert sent["hidden_states"].shape == (6, builtin_model_config("tiny").hidden_size)
    assert runner.execute_model_state is None  # nothing left for sample_tokens
    assert runner.num_requests() == 1


def test_non_last_rank_reports_its_connector_output_in_a_copy():
    connector = ReportsSends(
        KVTransferConfig(kv_connector="ReportsSends", kv_role="kv_producer"), role=1
    )
    runner, _ = first_stage_runner(ActiveKVConnector(connector))
    output = runner.execute_model(step(finished=frozenset({"old-request"})))
    assert isinstance(output, ModelRunnerOutput)
    assert output is not EMPTY_MODEL_RUNNER_OUTPUT
    assert output.kv_connector_output.finished_sending == {"old-request"}
    assert output.req_ids == () and output.sampled_token_ids == ()
    assert EMPTY_MODEL_RUNNER_OUTPUT.kv_connector_output is None
    assert not connector.has_connector_metadata()  # post_forward always clears
