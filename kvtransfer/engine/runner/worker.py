"""`Worker`: one ``(pp_rank, tp_rank)`` of an engine — its model shard, KV cache and runner.

The executor builds one per rank (in-process for a single worker, one process each otherwise)
and drives it with `initialize` once, then `execute_model` every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtransfer.connector.metadata import KVConnectorHandshakeMetadata, PpTpRank
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.model.loader import iter_weights, load_model_config
from kvtransfer.engine.outputs import IntermediateTensors, ModelRunnerOutput
from kvtransfer.engine.parallel import ParallelRank
from kvtransfer.engine.runner.devices import cuda_device_for
from kvtransfer.engine.runner.distributed import WorkerDistributed
from kvtransfer.engine.runner.drafters import DraftModelProposer, NgramDraftProposer
from kvtransfer.engine.runner.kv_cache import (
    group_caches,
    kv_cache_layout,
    num_kv_blocks,
    resolve_dtype,
)
from kvtransfer.engine.runner.kv_connector import KVConnector, make_kv_connector
from kvtransfer.engine.runner.model_runner import ModelRunner, Proposer
from kvtransfer.engine.scheduler_output import SchedulerOutput
from kvtransfer.engine.spec_decode import NgramProposer

DRAFT_LAYER_PREFIX = "draft.layers"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once `Worker.initialize` loaded its model and KV cache."""

    rank: ParallelRank
    num_kv_blocks: int
    handshake_metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata] | None
    layer_names: tuple[str, ...]
    # The worker's connector wakes `Executor.kv_events` when a transfer finishes.
    signals_kv_events: bool = False


class SingleProcessComm:
    """The collectives of a one-worker engine: there is nobody to talk to."""

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def tp_broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def pp_send(self, tensors: IntermediateTensors, dst_pp_rank: int) -> None:
        raise RuntimeError("a single-process engine has no next pipeline stage")

    def pp_recv(self, template: IntermediateTensors, src_pp_rank: int) -> IntermediateTensors:
        raise RuntimeError("a single-process engine has no previous pipeline stage")


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: ParallelRank,
        dist: WorkerDistributed | None,
        kv_event_signal: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        # Called by the connector when a transfer finishes (see `kvtransfer.engine.wakeup`).
        self.kv_event_signal = kv_event_signal
        self.comm = dist if dist is not None else SingleProcessComm()
        # Replaced in initialize(), once the layout the connector is told about is known.
        self.kv_connector: KVConnector = KVConnector()
        self.runner: ModelRunner | None = None
        # Every KV cache tensor (drafter's included), freed while the engine sleeps.
        self._kv_caches: dict[str, torch.Tensor] = {}

    def initialize(self) -> WorkerInfo:
        config, rank = self.config, self.rank
        device = torch.device(config.device)
        if config.device == "cuda":
            device = cuda_device_for(rank.rank)
            torch.cuda.set_device(device)
        dtype = resolve_dtype(config)
        all_reduce = self.comm.tp_all_reduce if rank.tp_size > 1 else None

        target_config = load_model_config(config.model)
        model = LlamaForCausalLM(target_config, rank, all_reduce, dtype, device)
        model.load_weights(iter_weights(config.model))

        spec = config.speculative
        drafter = draft_config = None
        if spec is not None and spec.method == "draft":
            draft_config = load_model_config(spec.draft_model)
            if draft_config.vocab_size != target_config.vocab_size:
                raise ValueError(
                    f"draft model {spec.draft_model!r} has vocab_size {draft_config.vocab_size} "
                    f"but the target has {target_config.vocab_size}; they must share a tokenizer"
                )
            if rank.is_last_pp_rank:
                # The drafter lives whole on the last stage, TP-sharded like the target.
                draft_rank = ParallelRank(rank.tp_rank, rank.tp_size, 0, 1)
                drafter = LlamaForCausalLM(
                    draft_config, draft_rank, all_reduce, dtype, device, DRAFT_LAYER_PREFIX
                )
                drafter.load_weights(iter_weights(spec.draft_model))

        num_blocks = num_kv_blocks(config, target_config, draft_config)
        target_caches = self._allocate(model, num_blocks, dtype, device)
        draft_caches = self._allocate(drafter, num_blocks, dtype, device) if drafter else {}
        all_caches = {**target_caches, **draft_caches}
        self._kv_caches = all_caches
        layout = kv_cache_layout(config, target_config, num_blocks, rank, tuple(draft_caches))
        self.kv_connector = make_kv_connector(config.kv_transfer_config, layout)
        self.kv_connector.register_kv_caches(all_caches)
        signals = self.kv_event_signal is not None and self.kv_connector.set_completion_callback(
            self.kv_event_signal
        )

        proposer: Proposer | None = None
        runner = ModelRunner(
            model,
            list(target_caches.values()),
            self.kv_connector,
            self.comm,
            block_size=config.block_size,
            pp_rank=rank.pp_rank,
            pp_size=rank.pp_size,
            proposer=None,
            device=device,
            defer_kv_finalize=spec is not None and spec.defer_kv_finalize,
        )
        if drafter is not None:
            proposer = DraftModelProposer(
                drafter,
                list(draft_caches.values()),
                self.kv_connector,
                self.comm,
                runner.requests,
                num_speculative_tokens=spec.num_speculative_tokens,
                block_size=config.block_size,
                device=device,
            )
        elif spec is not None and spec.method == "ngram" and rank.is_last_pp_rank:
            ngram = NgramProposer(
                spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens
            )
            proposer = NgramDraftProposer(ngram, runner.requests)
        runner.proposer = proposer
        self.runner = runner

        handshake = self.kv_connector.handshake_metadata()
        return WorkerInfo(
            rank=rank,
            num_kv_blocks=num_blocks,
            handshake_metadata={rank.key: handshake} if handshake is not None else None,
            layer_names=tuple(all_caches),
            signals_kv_events=signals,
        )

    def _allocate(
        self, model: LlamaForCausalLM, num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        specs = model.layer_caches(num_blocks, self.config.block_size)
        layer_groups = {layer.name: layer.kv_group for layer in model.layers}
        return group_caches(layer_groups, specs, dtype, device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        runner = self._runner()
        output = runner.execute_model(scheduler_output)
        if output is not None:
            return output
        return runner.sample_tokens()

    def sleep(self) -> None:
        """Free the KV caches' memory (the tensors stay, empty), after the connector dropped
        its registrations of it. The engine drained first: no request, no transfer."""
        self._runner()
        self.kv_connector.unregister_kv_caches()
        for cache in self._kv_caches.values():
            cache.untyped_storage().resize_(0)

    def wake_up(self) -> dict[PpTpRank, KVConnectorHandshakeMetadata] | None:
        """Map the KV caches again (new memory, zeroed: every view of them follows) and let
        the connector register it; the handshake metadata to publish anew."""
        self._runner()
        for cache in self._kv_caches.values():
            storage = cache.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(cache.numel() * cache.element_size())
                cache.zero_()
        self.kv_connector.restore_kv_caches()
        handshake = self.kv_connector.handshake_metadata()
        return {self.rank.key: handshake} if handshake is not None else None

    def num_requests(self) -> int:
        """Requests this worker still mirrors; 0 after the engine finished them (leak check)."""
        return self._runner().num_requests()

    def check_health(self) -> None:
        self._runner()

    def shutdown(self) -> None:
        self.kv_connector.shutdown()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"worker {self.rank.key} used before initialize()")
        return self.runner
