"""`ModelRunner`: one worker's device side, in Model Runner V2's shape.

A step is two calls, in this order, on every worker of the engine:

1. `execute_model(scheduler_output)`: mirror the scheduler's request state, build the batch,
   bind the connector's metadata (`pre_forward`), run this rank's layers (the connector's
   `wait_for_layer_load`/`save_kv_layer` run around every attention layer), and keep
   `ExecuteModelState`. A non-last pipeline rank sends its activations on and returns right away
   with nothing but its connector output (vLLM PR #43732); a zero-token step runs the connector
   alone (`no_forward`).
2. `sample_tokens()` (last pipeline rank): sample, verify drafts, run the proposer (whose draft
   model writes its own KV layers), and only then `post_forward` (wait for saves, collect
   finished transfers, clear the metadata): saves of the drafter's KV must be complete before a
   transfer is reported done (vLLM PR #43719). With ``defer_kv_finalize`` (vLLM 0.33's Model
   Runner V2 under a speculator) the results are collected before the proposer and the step
   finalized (`finalize_step`: wait for saves, clear) after it, so a send completing during
   this step's saves is reported one step later.

The runner never asks whether KV transfer is configured: it always holds a `KVConnector`,
which is a null object when transfer is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvtransfer.engine.config import MAMBA
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.outputs import IntermediateTensors, ModelRunnerOutput, TokenLogprobs
from kvtransfer.engine.runner.input_batch import ForwardBatch, SequenceChunk, build_forward_batch
from kvtransfer.engine.runner.kv_connector import KVConnector
from kvtransfer.engine.runner.request_states import RequestStates
from kvtransfer.engine.runner.sampler import sample, token_logprobs
from kvtransfer.engine.scheduler_output import SchedulerOutput
from kvtransfer.engine.spec_decode import accept_draft_tokens


class Comm(Protocol):
    """The collectives a runner needs (`kvtransfer.engine.runner.distributed.WorkerDistributed`)."""

    def tp_broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def pp_send(self, tensors: IntermediateTensors, dst_pp_rank: int) -> None: ...

    def pp_recv(self, template: IntermediateTensors, src_pp_rank: int) -> IntermediateTensors: ...


class Proposer(Protocol):
    """Proposes draft tokens for the requests that sampled this step."""

    def propose(self, step: StepResult) -> dict[str, list[int]]: ...


@dataclass(frozen=True)
class ScheduledRequest:
    req_id: str
    chunk: SequenceChunk  # tokens run this step (drafts last)
    num_drafts: int
    samples: bool  # False while the request is still prefilling known tokens


@dataclass(frozen=True)
class ExecuteModelState:
    """What `execute_model` leaves for `sample_tokens` (seed 000: finished ids, not a ready
    connector output, because the drafter has not written its KV yet)."""

    requests: tuple[ScheduledRequest, ...]
    batch: ForwardBatch
    hidden_states: torch.Tensor
    finished_req_ids: frozenset[str]


@dataclass(frozen=True)
class StepResult:
    """Verified tokens of this step, handed to the proposer."""

    requests: tuple[ScheduledRequest, ...]
    accepted: dict[str, list[int]]  # per sampling request, the tokens it keeps (>= 1)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[torch.Tensor],
        kv_connector: KVConnector,
        comm: Comm,
        *,
        block_size: int,
        pp_rank: int,
        pp_size: int,
        proposer: Proposer | None,
        device: torch.device,
        defer_kv_finalize: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.kv_connector = kv_connector
        self.comm = comm
        self.block_size = block_size
        self.pp_rank = pp_rank
        self.is_first_pp_rank = pp_rank == 0
        self.is_last_pp_rank = pp_rank == pp_size - 1
        # Only tp_rank 0 of the last stage has its output read (`Executor.output_rank`); the
        # other TP ranks sample the same tokens but skip the per-request extras nobody reads.
        self.reports_samples = model.rank.tp_rank == 0
        self.proposer = proposer
        self.defer_kv_finalize = defer_kv_finalize
        self.device = device
        self.requests = RequestStates()
        kinds = model.config.kv_group_kinds
        self._state_groups = frozenset(g for g, kind in enumerate(kinds) if kind == MAMBA)
        self.execute_model_state: ExecuteModelState | None = None

    # ------------------------------------------------------------------ step, part 1

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's layers; ``None`` means "call `sample_tokens` next"."""
        if self.execute_model_state is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between")
        self.requests.apply(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.kv_connector.no_forward(scheduler_output)

        requests = self._schedule_view(scheduler_output)
        batch = build_forward_batch(
            [r.chunk for r in requests], self.block_size, self.device, self._state_groups
        )
        self.kv_connector.pre_forward(scheduler_output)
        intermediate = None
        if not self.is_first_pp_rank:
            intermediate = self.comm.pp_recv(self._activation_template(batch), self.pp_rank - 1)
        hidden = self.model(
            batch.input_ids,
            batch.positions,
            self.kv_caches,
            batch.group_metadata,
            hooks=self.kv_connector,
            intermediate_tensors=intermediate,
        )
        finished = scheduler_output.finished_req_ids
        if not self.is_last_pp_rank:
            self.comm.pp_send(hidden, self.pp_rank + 1)
            return ModelRunnerOutput.with_kv_conn_output_only(
                self.kv_connector.post_forward(finished)
            )
        self.execute_model_state = ExecuteModelState(tuple(requests), batch, hidden, finished)
        return None

    def _schedule_view(self, scheduler_output: SchedulerOutput) -> list[ScheduledRequest]:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], dtype=np.int64)
        num_known = (
            np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
            - num_drafts
        )
        is_prefilling = self.requests.is_prefilling(req_ids, num_known)
        views = []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            tokens = state.token_ids[start : start + int(num_known[i])] + list(
                drafts.get(req_id, ())
            )
            views.append(
                ScheduledRequest(
                    req_id=req_id,
                    chunk=SequenceChunk(
                        tokens, start, state.block_ids, tuple(state.window_block_ids)
                    ),
                    num_drafts=int(num_drafts[i]),
                    samples=not bool(is_prefilling[i]),
                )
            )
        return views

    def _activation_template(self, batch: ForwardBatch) -> IntermediateTensors:
        shape = (batch.num_tokens, self.model.config.hidden_size)
        return IntermediateTensors(
            {
                name: torch.empty(shape, dtype=self.model.dtype, device=self.device)
                for name in ("hidden_states", "residual")
            }
        )

    # ------------------------------------------------------------------ step, part 2

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model")
        self.execute_model_state = None
        spec_token_ids: dict[str, list[int]] = {}
        if self.proposer is not None and self.defer_kv_finalize:
            # vLLM 0.33's order: results now, the drafter, then wait for every save and clear.
            try:
                accepted, logits_by_req, logprobs_by_req = self._sample(state)
                kv_connector_output = self.kv_connector.post_forward(
                    state.finished_req_ids, defer_finalize=True
                )
                spec_token_ids = self.proposer.propose(StepResult(state.requests, accepted))
            finally:
                self.kv_connector.finalize_step()
        else:
            try:
                accepted, logits_by_req, logprobs_by_req = self._sample(state)
                if self.proposer is not None:
                    spec_token_ids = self.proposer.propose(StepResult(state.requests, accepted))
            finally:
                # Even a failed step must clear the connector's metadata; after the proposer,
                # so the drafter's KV saves are waited for (seed 000).
                kv_connector_output = self.kv_connector.post_forward(state.finished_req_ids)
        req_ids = tuple(r.req_id for r in state.requests)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=tuple(tuple(accepted.get(r, ())) for r in req_ids),
            spec_token_ids=tuple(tuple(spec_token_ids.get(r, ())) for r in req_ids),
            sampled_logits=logits_by_req,
            sampled_logprobs=logprobs_by_req,
            kv_connector_output=kv_connector_output,
        )

    def _sample(
        self, state: ExecuteModelState
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], dict[str, list[TokenLogprobs]]]:
        rows: list[int] = []
        params, seeds, out_positions, owners = [], [], [], []
        for i, request in enumerate(state.requests):
            if not request.samples:
                continue
            req_state = self.requests[request.req_id]
            last = int(state.batch.last_rows[i])
            first = last - request.num_drafts
            for row in range(first, last + 1):
                rows.append(row)
                params.append(req_state.sampling_params)
                seeds.append(req_state.seed)
                out_positions.append(int(state.batch.positions[row]) + 1)
                owners.append(request.req_id)
        if not rows:
            return {}, {}, {}
        logits = self.model.compute_logits(state.hidden_states[torch.tensor(rows)])
        tokens = sample(logits, params, seeds, out_positions)
        tokens = self.comm.tp_broadcast_tokens(tokens).tolist()

        sampled: dict[str, list[int]] = {}
        logit_rows: dict[str, list[int]] = {}
        for index, (owner, token) in enumerate(zip(owners, tokens, strict=True)):
            sampled.setdefault(owner, []).append(token)
            logit_rows.setdefault(owner, []).append(index)
        accepted = {}
        logits_by_req = {}
        logprobs_by_req = {}
        by_id = {r.req_id: r for r in state.requests}
        for req_id, target_tokens in sampled.items():
            chunk_tokens = by_id[req_id].chunk.token_ids
            drafts = list(chunk_tokens[len(chunk_tokens) - by_id[req_id].num_drafts :])
            accepted[req_id] = accept_draft_tokens(drafts, target_tokens)
            # Rows of the accepted tokens only: a rejected draft's row was never an output.
            kept = logit_rows[req_id][: len(accepted[req_id])]
            sampling = self.requests[req_id].sampling_params
            if sampling.return_logits:
                logits_by_req[req_id] = logits[kept].float().cpu()
            if sampling.logprobs is not None and self.reports_samples:
                logprobs_by_req[req_id] = token_logprobs(
                    logits[kept], accepted[req_id], sampling.logprobs
                )
        return accepted, logits_by_req, logprobs_by_req

    # ------------------------------------------------------------------ bookkeeping

    def num_requests(self) -> int:
        """Requests this worker still mirrors (0 once the scheduler finished them all)."""
        return len(self.requests)
