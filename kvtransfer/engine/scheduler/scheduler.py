"""`Scheduler`: continuous batching over a paged KV pool, with prefix caching, chunked prefill,
preemption, speculative-decoding bookkeeping and the scheduler half of the KV connector.

One step is ``schedule()`` -> workers run the `SchedulerOutput` -> ``update_from_output()``.
The scheduler is the only place tokens are counted: ``num_computed_tokens`` advances when a
step is scheduled and rejected draft tokens are rolled back when its output arrives.

Block borrows by the connector (see `kvtransfer.connector.base`) outlive requests: a request
finished while its KV is still being loaded or saved keeps its blocks, keyed by its id, until
the matching ``finished_recving``/``finished_sending`` report; `has_pending_work` stays true
until then. `KVTransferState` keeps those borrows and the loads in flight and applies the
connector's results; `ConnectorHooks` makes the connector calls that may fail a request.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.outputs import ModelRunnerOutput
from kvtransfer.engine.scheduler.block_manager import BlockManager
from kvtransfer.engine.scheduler.connector_hooks import ConnectorHooks, KVConnectorHookError
from kvtransfer.engine.scheduler.kv_transfer_state import ConnectorResults, KVTransferState
from kvtransfer.engine.scheduler.request import (
    DuplicateRequestError,
    EngineCoreOutput,
    PromptTooLargeError,
    Request,
    RequestStatus,
)
from kvtransfer.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

__all__ = ["KVConnectorHookError", "Scheduler", "SchedulerStats"]


@dataclass
class SchedulerStats:
    """Cumulative counters since the scheduler was created (`Scheduler.stats` hands out
    copies)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0


class _Admit(enum.Enum):
    SCHEDULED = enum.auto()
    PARKED = enum.auto()  # async load started, or the request failed: look at the next one
    SKIP = enum.auto()  # connector does not know yet: ask again next step
    NO_SPACE = enum.auto()  # pool cannot take it now: stop admitting (FCFS)


@dataclass
class _Step:
    """What the `schedule()` call under way has decided so far."""

    budget: int
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    spec_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)

    def add(self, request: Request, num_new: int, new_blocks: list[int]) -> None:
        self.num_scheduled[request.request_id] = num_new
        self.new_blocks[request.request_id] = new_blocks
        self.scheduled.append(request)
        self.budget -= num_new


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
        connector: KVConnectorBase_V1 | None = None,
        extra_groups: Sequence[int | None] = (),
    ) -> None:
        """``extra_groups``: one per KV cache group after the full-attention one (a hybrid
        model's sliding window, or ``None`` for its recurrent state); see `BlockManager`."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.connector = connector
        self._hooks = ConnectorHooks(connector) if connector is not None else None
        kv_config = config.kv_transfer_config
        self.kv_load_failure_policy = kv_config.kv_load_failure_policy if kv_config else "fail"
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # The draft model writes KV for positions past the verified tokens.
        self.num_lookahead_tokens = (
            spec.num_speculative_tokens if spec and spec.method == "draft" else 0
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            extra_groups=extra_groups,
        )
        self._kv = KVTransferState(self.block_manager, self.kv_load_failure_policy)
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._finished_since_schedule: set[str] = set()
        self._early_outputs: list[EngineCoreOutput] = []
        # Finished ids the workers still hold state for (cleared once a step told them).
        self._unsynced_finishes: set[str] = set()
        # Outputs of requests that ended inside schedule(); returned by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self._next_arrival = 0
        self._stats = SchedulerStats()

    # ------------------------------------------------------------------ public state

    @property
    def stats(self) -> SchedulerStats:
        return dataclasses.replace(self._stats)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def num_running_requests(self) -> int:
        """Requests scheduled in steps now (holding blocks, computing)."""
        return len(self._running)

    @property
    def num_waiting_requests(self) -> int:
        """Unfinished requests not running: queued, preempted, or parked for remote KV or their
        first tokens."""
        return len(self._requests) - len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_work(self) -> bool:
        """Unfinished requests, blocks still borrowed by the connector (delayed frees, loads in
        flight of finished requests), or finished requests whose state the workers still hold
        (one more step tells them): the engine keeps stepping while this is true."""
        return bool(self._requests or self._kv.has_borrows() or self._unsynced_finishes)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def is_lending_blocks(self, request_id: str) -> bool:
        """Whether a finished request's blocks are still lent to the connector (a save for a
        remote decode, or a load that has not stopped writing)."""
        return self._kv.is_borrowed(request_id)

    def requests_loading_remote_kvs(self) -> list[Request]:
        """Requests parked in ``WAITING_FOR_REMOTE_KVS`` (their KV is being loaded)."""
        return [
            r for r in self._requests.values() if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        ]

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests or self._kv.is_borrowed(rid):
            raise DuplicateRequestError(f"request {rid}: duplicate request id")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid}: must be a new WAITING request")
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {rid}: empty prompt")
        self._check_vocab(rid, "prompt", request.prompt_token_ids)
        self._check_generated(request)
        if request.awaits_generated and request.output_token_ids:
            raise ValueError(f"request {rid}: awaits generated tokens but already has some")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt has {prompt_len} tokens but max_model_len is "
                f"{self.max_model_len} (no room to generate)"
            )
        needed = self.block_manager.blocks_needed(request.num_tokens + self.num_lookahead_tokens)
        if needed > self.block_manager.capacity:
            raise PromptTooLargeError(
                f"request {rid}: needs {needed} KV blocks ({request.num_tokens} prompt tokens + "
                f"{self.num_lookahead_tokens} lookahead, block_size "
                f"{self.block_manager.block_size}) but the pool has only "
                f"{self.block_manager.capacity}"
            )
        request.arrival_order = self._next_arrival
        request.arrived_at = time.monotonic()
        self._next_arrival += 1
        self._requests[rid] = request
        self._waiting.append(request)

    def _check_vocab(self, rid: str, what: str, tokens: Sequence[int]) -> None:
        for pos, token in enumerate(tokens):
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"request {rid}: {what} token {token} at position {pos} is outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )

    def _check_generated(self, request: Request) -> None:
        """Outputs a request arrives with (a prefill engine's first token) must leave it
        something to generate: fewer than max_tokens, and no end of sequence among them."""
        generated = request.output_token_ids
        if not generated:
            return
        rid = request.request_id
        self._check_vocab(rid, "generated", generated)
        params = request.sampling_params
        if len(generated) >= params.max_tokens:
            raise ValueError(
                f"request {rid}: {len(generated)} generated tokens leave nothing to generate "
                f"with max_tokens {params.max_tokens}"
            )
        eos = request.eos_token_id if request.eos_token_id is not None else self.eos_token_id
        if not params.ignore_eos and eos is not None and eos in generated:
            raise ValueError(
                f"request {rid}: generated tokens hold the end-of-sequence token {eos}: "
                "the request has ended already"
            )

    def continue_request(self, request_id: str, generated: Sequence[int]) -> None:
        """Give a request that `awaits_generated` its first output tokens (a prefill engine's
        first token); with none, it computes its first token itself (the prefill failed).

        Raises `KeyError` for a request that is not waiting for them, `ValueError` for tokens
        that would end it (they are checked as at `add_request`); nothing changes then."""
        request = self._requests.get(request_id)
        if request is None or not request.awaits_generated:
            raise KeyError(f"request {request_id} is not waiting for generated tokens")
        if generated:
            probe = dataclasses.replace(request, output_token_ids=list(generated))
            self._check_generated(probe)
            request.extend_output_tokens(generated)
        else:
            # Its loaded KV may cover every prompt token: the last one is computed again for
            # the logits of the first output token.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        request.awaits_generated = False
        request.continued_at = time.monotonic()

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort unfinished requests; unknown or already finished ids are ignored."""
        outputs = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                outputs.append(self._finish(request, RequestStatus.FINISHED_ABORTED))
        return outputs

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        new_reqs, cached_reqs = self._sync_scheduled(step)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            scheduled_spec_decode_tokens=step.spec_tokens,
            finished_req_ids=frozenset(self._finished_since_schedule),
            preempted_req_ids=frozenset(step.preempted),
        )
        self._finished_since_schedule.clear()
        self._unsynced_finishes.clear()
        if self.connector is not None:
            output = dataclasses.replace(
                output, kv_connector_metadata=self.connector.build_connector_meta(output)
            )
            for rid, params in self.connector.take_early_kv_transfer_params().items():
                if rid in self._requests:
                    self._early_outputs.append(
                        EngineCoreOutput(req_id=rid, kv_transfer_params=dict(params))
                    )
        return output

    def take_early_outputs(self) -> list[EngineCoreOutput]:
        """Outputs to hand over before the scheduled step runs: params a consumer may start
        with already (see `KVConnectorBase_V1.take_early_kv_transfer_params`)."""
        early, self._early_outputs = self._early_outputs, []
        return early

    def _schedule_running(self, step: _Step) -> None:
        """Give each running request its next tokens (and drafts) in order, while the budget
        lasts; preempts from the back when the pool runs out."""
        i = 0
        while i < len(self._running) and step.budget > 0:
            request = self._running[i]
            num_new = min(
                request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens,
                step.budget,
            )
            if num_new <= 0:
                i += 1
                continue
            added = self._allocate_running(request, num_new, step.preempted)
            if added is None:
                # The request itself was preempted (or failed); the list shrank under us.
                continue
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            if num_drafts > 0:
                step.spec_tokens[request.request_id] = tuple(request.spec_token_ids[:num_drafts])
            # Drafts cut off by the budget are stale next step: the step re-drafts.
            del request.spec_token_ids[max(num_drafts, 0) :]
            step.add(request, num_new, added)
            i += 1

    def _sync_scheduled(
        self, step: _Step
    ) -> tuple[tuple[NewRequestData, ...], tuple[CachedRequestData, ...]]:
        """Describe the scheduled requests for the workers (in full the first time, as a delta
        after that) and count this step's tokens as computed."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in step.scheduled:
            rid = request.request_id
            if request.known_to_workers:
                untold = self.block_manager.take_untold_blocks(rid)
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=tuple(request.all_token_ids[request.num_synced_tokens :]),
                        new_block_ids=untold[0],
                        num_computed_tokens=request.num_computed_tokens,
                        new_window_block_ids=untold[1:],
                    )
                )
            else:
                tables = self.block_manager.take_untold_blocks(rid)
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_len=request.num_prompt_tokens,
                        token_ids=tuple(request.all_token_ids),
                        sampling_params=request.sampling_params,
                        seed=request.seed,
                        block_ids=tables[0],
                        num_computed_tokens=request.num_computed_tokens,
                        window_block_ids=tables[1:],
                    )
                )
                request.known_to_workers = True
            request.num_synced_tokens = request.num_tokens
            request.num_computed_tokens += step.num_scheduled[rid]
            if request.first_scheduled_at is None:
                request.first_scheduled_at = time.monotonic()
        return tuple(new_reqs), tuple(cached_reqs)

    def _allocate_running(
        self, request: Request, num_new: int, preempted: set[str]
    ) -> list[int] | None:
        """Blocks for ``num_new`` more tokens, preempting the latest admitted requests as
        needed; ``None`` when ``request`` itself left the running list."""
        bm = self.block_manager
        while True:
            added = bm.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if added is not None:
                return added
            victim = self._running[-1]
            if victim is request and len(self._running) == 1:
                slots = request.num_computed_tokens + num_new + self.num_lookahead_tokens
                if bm.blocks_needed(slots) > bm.capacity:
                    # Only connector borrows could make room, and they cannot make enough.
                    self._fail_pending(
                        request,
                        f"request {request.request_id} needs {bm.blocks_needed(slots)} KV "
                        f"blocks for {slots} slots but the pool has only {bm.capacity}",
                    )
                    return None
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.known_to_workers = False
        self._waiting.appendleft(request)
        self._stats.num_preemptions += 1

    def _admit_waiting(self, step: _Step) -> None:
        skipped: list[Request] = []
        pool_exhausted = False
        while self._waiting and step.budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.popleft()
            with_kv = request.status is RequestStatus.WAITING_WITH_KV
            if with_kv and request.awaits_generated:
                result, num_new = _Admit.SKIP, 0  # loaded; computed once continued
            elif with_kv:
                result, num_new = self._resume_admitted(request, step.budget)
            elif pool_exhausted:
                # FCFS: nothing admitted ahead of a request the pool could not take. Requests
                # already holding blocks still go, or they could starve the pool forever.
                result, num_new = _Admit.SKIP, 0
            elif request.request_id in self._finished_since_schedule:
                # Its id is reused by a request that finished since the last step: the workers
                # learn of that end in this step and would take this one's load for the old
                # one's. It is admitted next step.
                result, num_new = _Admit.SKIP, 0
            else:
                result, num_new = self._admit(request, step.budget)
            if result is _Admit.NO_SPACE:
                pool_exhausted = True
                result = _Admit.SKIP
            if result is _Admit.SKIP:
                skipped.append(request)
                continue
            if result is _Admit.SCHEDULED:
                request.status = RequestStatus.RUNNING
                self._running.append(request)
                step.add(request, num_new, [])
        self._waiting.extendleft(reversed(skipped))

    def _resume_admitted(self, request: Request, budget: int) -> tuple[_Admit, int]:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        added = self.block_manager.allocate_slots(
            request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
        )
        if added is None:
            return _Admit.NO_SPACE, 0
        return _Admit.SCHEDULED, num_new

    def _admit(self, request: Request, budget: int) -> tuple[_Admit, int]:
        bm = self.block_manager
        rid = request.request_id
        if bm.blocks_needed(request.num_tokens + self.num_lookahead_tokens) > bm.capacity:
            self._fail_pending(
                request, f"request {rid} needs more KV blocks than the pool has ({bm.capacity})"
            )
            return _Admit.PARKED, 0
        hits, num_local = bm.get_computed_blocks(request)
        num_external, load_async = 0, False
        hooks = None if request.skip_connector else self._hooks
        if hooks is not None:
            try:
                num_external, load_async = hooks.get_num_new_matched_tokens(request, num_local)
            except KVConnectorHookError as exc:
                self._fail_pending(request, str(exc))
                return _Admit.PARKED, 0
            if num_external is None:
                return _Admit.SKIP, 0

        if hooks is not None and load_async and num_external > 0:
            added = bm.allocate_slots(request, num_external, hits)
            if added is None:
                return _Admit.NO_SPACE, 0
            # Only the windows' tails are loaded: the rest is not needed, nor held, but for
            # the prefix hit's window tail, which a failed load is recomputed after.
            bm.release_out_of_window(rid, num_local + num_external, spare_from=num_local)
            if not self._after_alloc(hooks, request, num_external):
                return _Admit.PARKED, 0
            self._count_prefix_hits(request, num_local)
            request.num_computed_tokens = num_local
            self._kv.start_load(request, num_external)
            return _Admit.PARKED, 0

        if request.awaits_generated:
            # Only a KV load may start before its first tokens arrive.
            return _Admit.SKIP, 0
        # The last token is always computed here: its logits give the first output token.
        num_computed = min(num_local + num_external, request.num_tokens - 1)
        num_new = min(request.num_tokens - num_computed, budget)
        added = bm.allocate_slots(
            request,
            num_computed - num_local + num_new,
            hits,
            num_lookahead_tokens=self.num_lookahead_tokens,
        )
        if added is None:
            return _Admit.NO_SPACE, 0
        if hooks is not None and not self._after_alloc(hooks, request, num_external):
            return _Admit.PARKED, 0
        self._count_prefix_hits(request, num_local)
        request.num_computed_tokens = num_computed
        return _Admit.SCHEDULED, num_new

    def _after_alloc(self, hooks: ConnectorHooks, request: Request, num_external: int) -> bool:
        """Tell the connector about the blocks; on a raising hook the request fails."""
        blocks = self.block_manager.get_group_block_ids(request.request_id)
        try:
            hooks.update_state_after_alloc(request, blocks, num_external)
        except KVConnectorHookError as exc:
            self._fail_pending(request, str(exc))
            return False
        return True

    def _count_prefix_hits(self, request: Request, num_local: int) -> None:
        request.num_cached_tokens = num_local
        self._stats.num_prefix_cache_queried_tokens += request.num_tokens
        self._stats.num_prefix_cache_hit_tokens += num_local

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        mro = model_runner_output
        self._check_runner_output(scheduler_output, mro)
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_results = self._apply_connector_output(mro.kv_connector_output)
        outputs.extend(kv_results.outputs)
        for rid in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (e.g. aborted) or preempted since it was scheduled
            if rid in kv_results.reset_ids:
                continue  # its KV is garbage; this step's sample is discarded
            output = self._update_request(request, scheduler_output, mro)
            if output is not None:
                outputs.append(output)
        return outputs

    def _apply_connector_output(self, kv_out: KVConnectorOutput | None) -> ConnectorResults:
        """Let the connector, then `KVTransferState`, act on this step's transfer results."""
        kv_out = kv_out or KVConnectorOutput()
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        results = self._kv.apply_connector_output(kv_out, self._running, self._finish_error)
        # Loaded requests already hold blocks: serve them before anything else that waits.
        self._waiting.extendleft(reversed(results.resumed))
        return results

    def _check_runner_output(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        """Refuse an output that does not match the step before touching any state."""
        for rid in so.num_scheduled_tokens:
            request = self._requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            sampled = _row(mro.sampled_token_ids, mro.req_id_to_index.get(rid))
            drafts = so.scheduled_spec_decode_tokens.get(rid, ())
            # num_computed_tokens already counts this step; reaching num_tokens means the step
            # computed the last known token, so it must have sampled.
            expects_sample = request.num_computed_tokens >= request.num_tokens
            if expects_sample and not 1 <= len(sampled) <= len(drafts) + 1:
                raise ValueError(
                    f"model runner output for request {rid}: expected 1 to {len(drafts) + 1} "
                    f"sampled tokens, got {len(sampled)}"
                )
            if not expects_sample and sampled:
                raise ValueError(
                    f"model runner output for request {rid}: sampled {len(sampled)} tokens in "
                    f"a chunk that stops short of its last token ({request.num_computed_tokens} "
                    f"of {request.num_tokens} computed)"
                )
            # Entries are matched to tokens by position downstream (the daemon labels each
            # streamed token with one): a short or missing list would mislabel them silently.
            logprobs = mro.sampled_logprobs.get(rid, ())
            if request.sampling_params.logprobs is not None and len(logprobs) != len(sampled):
                raise ValueError(
                    f"model runner output for request {rid}: {len(logprobs)} logprobs entries "
                    f"for {len(sampled)} sampled tokens"
                )

    def _update_request(
        self, request: Request, so: SchedulerOutput, mro: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        rid = request.request_id
        index = mro.req_id_to_index.get(rid)
        sampled = _row(mro.sampled_token_ids, index)
        drafts = so.scheduled_spec_decode_tokens.get(rid, ())
        num_accepted = 0
        if drafts:
            num_accepted = len(sampled) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            self._stats.num_draft_tokens += len(drafts)
            self._stats.num_accepted_tokens += num_accepted
        request.spec_token_ids.clear()

        new_tokens: list[int] = []
        stop_status: RequestStatus | None = None
        for token in sampled:
            request.append_output_token(token)
            new_tokens.append(token)
            stop_status = self._check_stop(request, token)
            if stop_status is not None:
                break

        if new_tokens:
            request.record_sampled(len(new_tokens))
        if stop_status is None and new_tokens and self.num_spec_tokens:
            # Drafts continue the token just sampled; a prefill chunk has none to continue.
            proposed = _row(mro.spec_token_ids, index)
            request.spec_token_ids = list(proposed[: self._max_drafts(request)])
        # Only KV of computed, verified positions is published.
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        self.block_manager.release_out_of_window(rid, request.num_computed_tokens)

        logits = None
        if request.sampling_params.return_logits and new_tokens:
            rows = mro.sampled_logits.get(rid)
            if rows is not None:
                logits = rows[: len(new_tokens)]
        # Cut like the tokens: none past a stop.
        logprobs = tuple(mro.sampled_logprobs.get(rid, ())[: len(new_tokens)])
        if stop_status is not None:
            return dataclasses.replace(
                self._finish(request, stop_status),
                new_token_ids=tuple(new_tokens),
                logits=logits,
                logprobs=logprobs,
                num_draft_tokens=len(drafts),
                num_accepted_tokens=num_accepted,
            )
        if not new_tokens:
            return None
        return EngineCoreOutput(
            req_id=rid,
            new_token_ids=tuple(new_tokens),
            logits=logits,
            logprobs=logprobs,
            num_draft_tokens=len(drafts),
            num_accepted_tokens=num_accepted,
        )

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        eos = request.eos_token_id if request.eos_token_id is not None else self.eos_token_id
        if not params.ignore_eos and eos is not None and token == eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _max_drafts(self, request: Request) -> int:
        # Verifying d drafts yields up to d + 1 tokens; drafts past the limits are wasted work.
        left_by_max_tokens = request.sampling_params.max_tokens - request.num_output_tokens
        left_by_model_len = self.max_model_len - request.num_tokens
        return max(0, min(self.num_spec_tokens, left_by_max_tokens - 1, left_by_model_len - 1))

    # ------------------------------------------------------------------ finishing

    def _finish(
        self, request: Request, status: RequestStatus, error: str | None = None
    ) -> EngineCoreOutput:
        """End ``request``: notify the connector, free or lend its blocks, build its output."""
        rid = request.request_id
        was_loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        self._remove_from_queues(request)
        del self._requests[rid]
        self._finished_since_schedule.add(rid)
        if request.known_to_workers:
            self._unsynced_finishes.add(rid)
        request.spec_token_ids.clear()
        delay_free, params = False, None
        if self._hooks is not None:
            blocks = self.block_manager.get_group_block_ids(rid)
            try:
                delay_free, params = self._hooks.request_finished(request, blocks)
            except KVConnectorHookError as exc:
                status, error = RequestStatus.FINISHED_ERROR, str(exc)
        request.status = status
        request.error = error
        self._kv.release_finished(rid, loading=was_loading, saving=delay_free)
        return EngineCoreOutput(
            req_id=rid,
            finished=True,
            finish_reason=status.finish_reason,
            error=error,
            kv_transfer_params=params,
            num_cached_tokens=request.num_cached_tokens,
            kv_stats=dataclasses.replace(request.kv_stats),
            timings=request.timings(),
        )

    def _finish_error(self, request: Request, error: str) -> EngineCoreOutput:
        return self._finish(request, RequestStatus.FINISHED_ERROR, error)

    def _fail_pending(self, request: Request, error: str) -> None:
        """Fail ``request`` inside `schedule()`; the next `update_from_output` reports it."""
        self._pending_outputs.append(self._finish_error(request, error))

    def _remove_from_queues(self, request: Request) -> None:
        rid = request.request_id
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._kv.forget_load(rid)
        elif request in self._waiting:
            self._waiting.remove(request)


def _row(rows: Sequence[Sequence[int]], index: int | None) -> Sequence[int]:
    if index is None or index >= len(rows):
        return ()
    return rows[index]
