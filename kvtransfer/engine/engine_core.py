"""`EngineCore`: the scheduler process of one engine — scheduler, executor, aggregator.

Life cycle of a request:

1. `add_request` validates it and queues it WAITING in the scheduler.
2. `step` → `Scheduler.schedule`: admitted (prefix-cache hit, then the connector's
   `get_num_new_matched_tokens`); a request whose KV a connector loads asynchronously parks in
   WAITING_FOR_REMOTE_KVS, the others get tokens this step (chunked prefill, preemption when
   the block pool runs out).
3. `Executor.execute_model` runs the step on every worker; zero-token steps still reach the
   workers so their connectors make progress.
4. `KVOutputAggregator` merges the workers' outputs: a transfer is finished only when every
   worker reported it.
5. `Scheduler.update_from_output` appends tokens, rolls back rejected drafts, leaves
   WAITING_FOR_REMOTE_KVS on received (or applies `kv_load_failure_policy` on failure),
   and finishes requests; `request_finished` may keep their blocks until `finished_sending`.
6. The request's `EngineCoreOutput`s go back to the caller; `abort_request` ends it early
   (blocks a transfer may still write stay allocated until it reports).

`sleep` (once drained) frees the KV pool after the connectors dropped their registrations;
`wake_up` maps it again, the connectors register it anew and the engine publishes their new
handshake metadata. Asleep, the engine refuses requests; one that names a producer's KV is
added and aborted at once first (as vLLM 0.33's paused engine does), so the connector tells the
producer to free it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvtransfer.connector.aggregator import KVOutputAggregator
from kvtransfer.connector.base import KVConnectorBase_V1, supports_hma
from kvtransfer.connector.factory import KVConnectorFactory
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorRole,
    merge_handshake_metadata,
)
from kvtransfer.connector.topology import kv_head_range
from kvtransfer.engine.config import MAMBA, EngineConfig, ModelConfig
from kvtransfer.engine.executor.executor import DEFAULT_WORKER, Executor
from kvtransfer.engine.model.loader import load_model_config
from kvtransfer.engine.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, step_output
from kvtransfer.engine.runner.kv_cache import extra_kv_groups, kv_cache_layout
from kvtransfer.engine.runner.worker import DRAFT_LAYER_PREFIX
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler.request import EngineCoreOutput, Request
from kvtransfer.engine.scheduler.scheduler import Scheduler
from kvtransfer.engine.wakeup import Wakeup

# An idle step (nothing to compute, transfers in flight) of an engine whose connectors cannot
# wake it sleeps this long before polling them again.
IDLE_STEP_SLEEP_S = 0.001
# One whose connectors wake it (`Wakeup`) sleeps until woken, at most this long: a safety net
# for what no signal announces (leases running out, releases arriving on the scheduler side).
IDLE_WAIT_CAP_S = 0.05


class EngineSleepingError(RuntimeError):
    """The engine is asleep, or cannot sleep now; the call changed nothing."""


class EngineCore:
    def __init__(self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER) -> None:
        self.config = config
        self.model_config = load_model_config(config.model)
        check_parallel_fit(config, self.model_config)
        _check_recurrent_fit(config, self.model_config)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.connector: KVConnectorBase_V1 | None = None
        if config.kv_transfer_config is not None and config.kv_transfer_config.kv_connector:
            # An unknown or unloadable connector fails here, typed, before workers start.
            KVConnectorFactory.get_connector_class(config.kv_transfer_config)
        self.executor = Executor.create(config, worker_cls)
        try:
            worker_infos = self.executor.initialize()
        except BaseException:
            self.shutdown()
            raise
        self.worker_infos = tuple(worker_infos)
        # Every worker's connector wakes the engine: idle steps sleep until woken, not poll.
        self.wakes_on_kv_events = all(info.signals_kv_events for info in worker_infos)
        self._interrupts: list[Wakeup] = []
        # Whether the latest step computed nothing and saw no transfer finish (`wait_if_idle`).
        self.last_step_idle = False
        # Takes outputs due before a step runs (early KV params); without one they lead the
        # step's own outputs.
        self.early_output_sink: Callable[[list[EngineCoreOutput]], None] | None = None
        self.num_kv_blocks = worker_infos[0].num_kv_blocks
        self.is_sleeping = False
        draft_layers = tuple(
            name for name in worker_infos[0].layer_names if name.startswith(DRAFT_LAYER_PREFIX)
        )
        layout = kv_cache_layout(config, self.model_config, self.num_kv_blocks, None, draft_layers)
        try:
            self.connector = create_scheduler_connector(config, layout)
            _check_follows_groups(self.connector, self.model_config)
        except BaseException:
            self.shutdown()
            raise
        if self.connector is not None:
            merged = merge_handshake_metadata([info.handshake_metadata for info in worker_infos])
            if merged:
                self.connector.set_xfer_handshake_metadata_pp_aware(merged)
            signal = self.executor.kv_events.signal
            self.wakes_on_kv_events &= self.connector.set_completion_callback(signal)
        self.scheduler = Scheduler(
            config,
            num_blocks=self.num_kv_blocks,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_id=self.model_config.eos_token_id,
            connector=self.connector,
            extra_groups=extra_kv_groups(self.model_config),
        )
        self.aggregator = (
            KVOutputAggregator.from_connector(self.connector, self.executor.world_size)
            if self.connector is not None
            else KVOutputAggregator(self.executor.world_size)
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        kv_transfer_params: Mapping[str, Any] | None = None,
        generated_token_ids: Sequence[int] = (),
        awaits_generated: bool = False,
    ) -> None:
        """Queue a request. ``generated_token_ids`` are outputs it already has (a prefill
        engine's first token): it continues after them (see `Scheduler.add_request`).
        ``awaits_generated``: they come later, through `continue_request`."""
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, Mapping):
            raise ValueError(
                f"request {request_id!r}: kv_transfer_params must be an object (dict), "
                f"got {type(kv_transfer_params).__name__}"
            )
        if self.connector is not None:
            try:
                self.connector.validate_kv_transfer_params(kv_transfer_params)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        if self.is_sleeping:
            if kv_transfer_params and self.connector is not None:
                # As vLLM 0.33's paused engine: added and aborted at once, so the connector
                # tells the producer holding its KV that nobody will read it.
                self._queue(request_id, prompt_token_ids, sampling_params, kv_transfer_params)
                self.scheduler.abort_requests([request_id])
            raise EngineSleepingError(
                f"request {request_id!r}: the engine is asleep (its KV cache is freed); wake it "
                "up first"
            )
        self._queue(
            request_id,
            prompt_token_ids,
            sampling_params,
            kv_transfer_params,
            generated_token_ids,
            awaits_generated,
        )

    def _queue(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        kv_transfer_params: Mapping[str, Any] | None,
        generated_token_ids: Sequence[int] = (),
        awaits_generated: bool = False,
    ) -> None:
        seed = sampling_params.seed
        if seed is None:
            seed = random.getrandbits(63)
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=tuple(prompt_token_ids),
                sampling_params=sampling_params,
                seed=seed,
                kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
                eos_token_id=self.model_config.eos_token_id,
                output_token_ids=[int(t) for t in generated_token_ids],
                awaits_generated=awaits_generated,
            )
        )

    def continue_request(self, request_id: str, generated_token_ids: Sequence[int]) -> None:
        """See `Scheduler.continue_request`."""
        self.scheduler.continue_request(request_id, [int(t) for t in generated_token_ids])

    def abort_request(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(list(request_ids))

    def release_kv(self, kv_transfer_params: Mapping[str, Any]) -> bool:
        """Give back KV held for a consumer before it is pulled (see
        `KVConnectorBase_V1.release_kv`); False when nothing was held or no connector runs."""
        if not isinstance(kv_transfer_params, Mapping):
            raise ValueError(
                "kv_transfer_params must be an object (dict), got "
                f"{type(kv_transfer_params).__name__}"
            )
        if self.connector is None:
            return False
        return self.connector.release_kv(kv_transfer_params)

    def add_interrupt(self, wakeup: Wakeup) -> None:
        """Let ``wakeup`` end an idle step's sleep too (the caller drains it): e.g. set when
        a new request is queued for the thread that steps this engine."""
        self._interrupts.append(wakeup)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        early = self.scheduler.take_early_outputs()
        if early and self.early_output_sink is not None:
            self.early_output_sink(early)  # a consumer starts while this step computes
            early = []
        worker_outputs = self.executor.execute_model(scheduler_output)
        merged_kv = self.aggregator.aggregate(
            [o.kv_connector_output if o is not None else None for o in worker_outputs]
        )
        output = step_output(worker_outputs, self.executor.output_rank, merged_kv)
        outputs = early + self.scheduler.update_from_output(
            scheduler_output, output or EMPTY_MODEL_RUNNER_OUTPUT
        )
        self.last_step_idle = (
            scheduler_output.total_num_scheduled_tokens == 0 and not _reports_transfers(output)
        )
        return outputs

    def wait_if_idle(self) -> None:
        """What a loop that steps this engine calls after each step. When that step computed
        nothing and no transfer finished (only an in-flight load or save can move things on),
        wait for a transfer to finish or an interrupt (at most `IDLE_WAIT_CAP_S`) instead of
        spinning, so the connectors' threads get the GIL; otherwise return at once.

        `step` itself never waits: the loop's owner knows whether it has other work (a
        daemon's queued calls) that must not wait behind an idle engine."""
        if not self.last_step_idle or not self.scheduler.has_pending_work():
            return
        if self.wakes_on_kv_events:
            self.executor.kv_events.wait(IDLE_WAIT_CAP_S, self._interrupts)
        else:
            time.sleep(IDLE_STEP_SLEEP_S)

    def sleep(self, drain_timeout_s: float = 30.0) -> None:
        """Free the KV pool: drain (`EngineSleepingError` if requests are still running),
        let every worker's connector unregister the caches, free them, and forget the prefix
        cache (its blocks' content is gone). Idempotent."""
        if self.is_sleeping:
            return
        connector = self.connector
        if connector is not None and not type(connector).supports_sleep_mode(
            connector.kv_transfer_config
        ):
            raise EngineSleepingError(
                f"cannot sleep: {type(connector).__name__} does not follow a sleep (its "
                "supports_sleep_mode answers False); freeing the KV pool would leave it "
                "serving freed memory"
            )
        if self.has_unfinished_requests():
            raise EngineSleepingError(
                "cannot sleep with unfinished requests: finish or abort them first"
            )
        self.drain(drain_timeout_s)
        self.executor.sleep()
        self.scheduler.block_manager.reset_prefix_cache()
        self.is_sleeping = True

    def wake_up(self) -> None:
        """Map the KV pool again; the connectors register it and the engine publishes their
        new handshake metadata (the last publication wins: consumers holding the old one get a
        typed error and handshake again). Idempotent."""
        if not self.is_sleeping:
            return
        handshakes = self.executor.wake_up()
        if self.connector is not None:
            merged = merge_handshake_metadata([h for h in handshakes if h])
            if merged:
                self.connector.set_xfer_handshake_metadata_pp_aware(merged)
        self.is_sleeping = False

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self) -> bool:
        """Unfinished requests, or blocks a connector still borrows: keep stepping."""
        return self.scheduler.has_pending_work()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Step until no connector borrows blocks any more, plus one step so the workers learn
        about every finished request (zero-token steps run the connectors alone)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pending = self.has_pending_work()
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine still has pending work after {timeout_s:.0f} s: "
                    f"{self.scheduler.block_manager.num_used_blocks} blocks in use"
                )
            self.step()
            if not pending:
                return
            self.wait_if_idle()

    def check_no_leaks(self) -> None:
        """Raise unless every block is free, no completion is half-aggregated and no worker
        still holds request state (call after the engine drained)."""
        self.scheduler.block_manager.check_no_leaks()
        if self.aggregator.num_pending():
            raise RuntimeError(
                f"{self.aggregator.num_pending()} transfer completion(s) reported by only some "
                "workers"
            )
        held = self.executor.num_worker_requests()
        if any(held):
            raise RuntimeError(f"workers still hold request state: per rank {held}")

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()
        if self.connector is not None:
            self.connector.shutdown()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def create_scheduler_connector(
    config: EngineConfig, layout: KVCacheLayout
) -> KVConnectorBase_V1 | None:
    kv_config = config.kv_transfer_config
    if kv_config is None or kv_config.kv_connector is None:
        return None
    return KVConnectorFactory.create_connector(kv_config, KVConnectorRole.SCHEDULER, layout)


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    if config.max_model_len is None:
        return model.max_position_embeddings
    if config.max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings {model.max_position_embeddings}"
        )
    return config.max_model_len


def check_parallel_fit(config: EngineConfig, model: ModelConfig) -> None:
    """Fail before any process starts when the model cannot be split this way."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    problems = []
    if model.num_attention_heads % tp:
        problems.append(f"num_attention_heads {model.num_attention_heads} not divisible by TP {tp}")
    if model.intermediate_size % tp:
        problems.append(f"intermediate_size {model.intermediate_size} not divisible by TP {tp}")
    try:
        kv_head_range(0, tp, model.num_key_value_heads)
    except ValueError as exc:
        problems.append(str(exc))
    if model.num_hidden_layers < pp:
        problems.append(f"{model.num_hidden_layers} layers cannot fill {pp} pipeline stages")
    if problems:
        raise ValueError(
            f"model {config.model!r} cannot run with TP={tp} PP={pp}: " + "; ".join(problems)
        )


def _reports_transfers(output: ModelRunnerOutput | None) -> bool:
    """Whether the step's output holds transfer results the scheduler just acted on (so the
    next step may have work at once)."""
    kv = output.kv_connector_output if output is not None else None
    if kv is None:
        return False
    return bool(kv.finished_recving or kv.finished_sending or kv.invalid_block_ids)


def _check_follows_groups(connector: KVConnectorBase_V1 | None, model: ModelConfig) -> None:
    """A hybrid model's KV is several block tables: a connector that knows only one would move
    the wrong blocks, so it is refused before the engine serves anything."""
    # The base class itself is the no-op connector: it moves nothing, so it follows anything.
    if connector is None or not model.is_hybrid or type(connector) is KVConnectorBase_V1:
        return
    if supports_hma(connector):
        return
    raise ValueError(
        f"KV connector {type(connector).__name__} does not support hybrid KV caches "
        "(SupportsHMA), and this model has a sliding-window group (window "
        f"{model.sliding_window}) beside full attention; use one that does, such as "
        "UcxConnector"
    )


def _check_recurrent_fit(config: EngineConfig, model: ModelConfig) -> None:
    """What a model with Mamba layers cannot do here, refused before any worker starts."""
    if MAMBA not in model.layer_types:
        return
    if config.speculative is not None:
        raise ValueError(
            "speculative decoding is not supported for a model with Mamba layers: a recurrent "
            "state cannot be rewound past rejected draft tokens"
        )
    if model.mamba_num_heads % config.tensor_parallel_size:
        raise ValueError(
            f"mamba_num_heads ({model.mamba_num_heads}) must be divisible by "
            f"tensor_parallel_size {config.tensor_parallel_size}"
        )
