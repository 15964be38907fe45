"""`Scheduler`: continuous batching over a paged KV pool, with prefix caching, chunked prefill,
preemption, speculative-decoding bookkeeping and the scheduler half of the KV connector.

One step is ``schedule()`` -> workers run the `SchedulerOutput` -> ``update_from_output()``.
The scheduler is the only place tokens are counted: ``num_computed_tokens`` advances when a
step is scheduled and rejected draft tokens are rolled back when its output arrives.

Block borrows by the connector (see `kvtransfer.connector.base`) outlive requests: a request
finished while its KV is still being loaded or saved keeps its blocks, keyed by its id, until
the matching ``finished_recving``/``finished_sending`` report; `has_pending_work` stays true
until then.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.engine.block_manager import BlockManager
from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.request import EngineCoreOutput, Request, RequestStatus
from kvtransfer.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvtransfer.outputs import KVConnectorOutput, ModelRunnerOutput

_RECV = "recv"
_SEND = "send"


class KVConnectorHookError(RuntimeError):
    """A scheduler-role connector hook raised or answered something impossible for a request;
    only that request fails."""


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


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
        connector: KVConnectorBase_V1 | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.connector = connector
        kv_config = config.kv_transfer_config
        self.kv_load_failure_policy = kv_config.kv_load_failure_policy if kv_config else "fail"
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # The draft model writes KV for positions past the verified tokens.
        self.num_lookahead_tokens = (
            spec.num_speculative_tokens if spec and spec.method == "draft" else 0
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._loading: dict[str, Request] = {}
        # Finished request id -> borrows ("recv"/"send") still keeping its blocks.
        self._borrows: dict[str, set[str]] = {}
        self._finished_since_schedule: set[str] = set()
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

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_work(self) -> bool:
        """Unfinished requests, blocks still borrowed by the connector (delayed frees, loads in
        flight of finished requests), or finished requests whose state the workers still hold
        (one more step tells them): the engine keeps stepping while this is true."""
        return bool(self._requests or self._borrows or self._unsynced_finishes)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests or rid in self._borrows:
            raise ValueError(f"request {rid}: duplicate request id")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid}: must be a new WAITING request without outputs")
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError(f"request {rid}: empty prompt")
        for pos, token in enumerate(request.prompt_token_ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"request {rid}: prompt token {token} at position {pos} is outside the "
                    f"vocabulary [0, {self.vocab_size})"
                )
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt has {prompt_len} tokens but max_model_len is "
                f"{self.max_model_len} (no room to generate)"
            )
        needed = self.block_manager.blocks_needed(prompt_len + self.num_lookahead_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {rid}: needs {needed} KV blocks ({prompt_len} prompt tokens + "
                f"{self.num_lookahead_tokens} lookahead, block_size "
                f"{self.block_manager.block_size}) but the pool has only "
                f"{self.block_manager.num_blocks}"
            )
        request.arrival_order = self._next_arrival
        self._next_arrival += 1
        self._requests[rid] = request
        self._waiting.append(request)

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
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, tuple[int, ...]] = {}
        scheduled: list[Request] = []
        new_blocks: dict[str, list[int]] = {}
        preempted: set[str] = set()

        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            num_new = min(
                request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens,
                budget,
            )
            if num_new <= 0:
                i += 1
                continue
            added = self._allocate_running(request, num_new, preempted)
            if added is None:
                # The request itself was preempted (or failed); the list shrank under us.
                continue
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            if num_drafts > 0:
                spec_tokens[request.request_id] = tuple(request.spec_token_ids[:num_drafts])
            # Drafts cut off by the budget are stale next step: the step re-drafts.
            del request.spec_token_ids[max(num_drafts, 0) :]
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = added
            scheduled.append(request)
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, scheduled, new_blocks)

        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in scheduled:
            rid = request.request_id
            if request.known_to_workers:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=tuple(request.all_token_ids[request.num_synced_tokens :]),
                        new_block_ids=tuple(new_blocks[rid]),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_len=request.num_prompt_tokens,
                        token_ids=tuple(request.all_token_ids),
                        sampling_params=request.sampling_params,
                        seed=request.seed,
                        block_ids=tuple(self.block_manager.get_block_ids(rid)),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
                request.known_to_workers = True
            request.num_synced_tokens = request.num_tokens
            request.num_computed_tokens += num_scheduled[rid]

        output = SchedulerOutput(
            scheduled_new_reqs=tuple(new_reqs),
            scheduled_cached_reqs=tuple(cached_reqs),
            num_scheduled_tokens=num_scheduled,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=frozenset(self._finished_since_schedule),
            preempted_req_ids=frozenset(preempted),
        )
        self._finished_since_schedule.clear()
        self._unsynced_finishes.clear()
        if self.connector is not None:
            output = dataclasses.replace(
                output, kv_connector_metadata=self.connector.build_connector_meta(output)
            )
        return output

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
                if bm.blocks_needed(slots) > bm.num_blocks:
                    # Only connector borrows could make room, and they cannot make enough.
                    self._pending_outputs.append(
                        self._finish(
                            request,
                            RequestStatus.FINISHED_ERROR,
                            f"request {request.request_id} needs {bm.blocks_needed(slots)} KV "
                            f"blocks for {slots} slots but the pool has only {bm.num_blocks}",
                        )
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
        request.admitted = False
        self._waiting.appendleft(request)
        self._stats.num_preemptions += 1

    def _admit_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        scheduled: list[Request],
        new_blocks: dict[str, list[int]],
    ) -> int:
        skipped: list[Request] = []
        pool_exhausted = False
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.popleft()
            if request.admitted:
                result, num_new = self._resume_admitted(request, budget)
            elif pool_exhausted:
                # FCFS: nothing admitted ahead of a request the pool could not take. Requests
                # already holding blocks still go, or they could starve the pool forever.
                result, num_new = _Admit.SKIP, 0
            else:
                result, num_new = self._admit(request, budget)
            if result is _Admit.NO_SPACE:
                pool_exhausted = True
                result = _Admit.SKIP
            if result is _Admit.SKIP:
                skipped.append(request)
                continue
            if result is _Admit.SCHEDULED:
                rid = request.request_id
                request.status = RequestStatus.RUNNING
                request.admitted = False
                self._running.append(request)
                num_scheduled[rid] = num_new
                new_blocks[rid] = []
                scheduled.append(request)
                budget -= num_new
        self._waiting.extendleft(reversed(skipped))
        return budget

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
        if bm.blocks_needed(request.num_tokens + self.num_lookahead_tokens) > bm.num_blocks:
            self._pending_outputs.append(
                self._finish(
                    request,
                    RequestStatus.FINISHED_ERROR,
                    f"request {rid} needs more KV blocks than the pool has ({bm.num_blocks})",
                )
            )
            return _Admit.PARKED, 0
        hits, num_local = bm.get_computed_blocks(request)
        num_external, load_async = 0, False
        use_connector = self.connector is not None and not request.skip_connector
        if use_connector:
            try:
                answer = self._call_connector(
                    request, "get_num_new_matched_tokens", request, num_local
                )
                num_external, load_async = self._check_matched(request, num_local, answer)
            except KVConnectorHookError as exc:
                self._pending_outputs.append(
                    self._finish(request, RequestStatus.FINISHED_ERROR, str(exc))
                )
                return _Admit.PARKED, 0
            if num_external is None:
                return _Admit.SKIP, 0

        if load_async and num_external > 0:
            added = bm.allocate_slots(request, num_external, hits)
            if added is None:
                return _Admit.NO_SPACE, 0
            if not self._after_alloc(request, num_external):
                return _Admit.PARKED, 0
            self._count_prefix_hits(request, num_local)
            request.num_computed_tokens = num_local
            request.num_external_tokens = num_external
            request.load_failed = False
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._loading[rid] = request
            return _Admit.PARKED, 0

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
        if use_connector and not self._after_alloc(request, num_external):
            return _Admit.PARKED, 0
        self._count_prefix_hits(request, num_local)
        request.num_computed_tokens = num_computed
        return _Admit.SCHEDULED, num_new

    def _check_matched(
        self, request: Request, num_local: int, answer: Any
    ) -> tuple[int | None, bool]:
        name = type(self.connector).__name__
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise KVConnectorHookError(
                f"KV connector {name}.get_num_new_matched_tokens returned {answer!r} for "
                f"request {request.request_id}, expected (num_external_tokens, load_kv_async)"
            )
        num_external, load_async = answer
        if num_external is None:
            return None, bool(load_async)
        allowed = request.num_tokens - num_local
        if isinstance(num_external, bool) or not isinstance(num_external, int):
            raise KVConnectorHookError(
                f"KV connector {name}.get_num_new_matched_tokens returned non-int "
                f"{num_external!r} external tokens for request {request.request_id}"
            )
        if not 0 <= num_external <= allowed:
            raise KVConnectorHookError(
                f"KV connector {name} offered {num_external} external tokens for request "
                f"{request.request_id}, but only {allowed} of its {request.num_tokens} tokens "
                f"are not cached locally ({num_local} are)"
            )
        return num_external, bool(load_async)

    def _after_alloc(self, request: Request, num_external: int) -> bool:
        """Tell the connector about the blocks; on a raising hook the request fails."""
        blocks = self.block_manager.get_block_ids(request.request_id)
        try:
            self._call_connector(request, "update_state_after_alloc", request, blocks, num_external)
        except KVConnectorHookError as exc:
            self._pending_outputs.append(
                self._finish(request, RequestStatus.FINISHED_ERROR, str(exc))
            )
            return False
        return True

    def _count_prefix_hits(self, request: Request, num_local: int) -> None:
        request.num_cached_tokens = num_local
        self._stats.num_prefix_cache_queried_tokens += request.num_tokens
        self._stats.num_prefix_cache_hit_tokens += num_local

    def _call_connector(self, request: Request, hook: str, *args: Any) -> Any:
        method = getattr(self.connector, hook)
        try:
            return method(*args)
        except Exception as exc:
            raise KVConnectorHookError(
                f"KV connector {type(self.connector).__name__}.{hook} raised for request "
                f"{request.request_id}: {type(exc).__name__}: {exc}"
            ) from exc

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        mro = model_runner_output
        self._check_runner_output(scheduler_output, mro)
        outputs, self._pending_outputs = self._pending_outputs, []

        kv_out = mro.kv_connector_output or KVConnectorOutput()
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        reset_ids = self._handle_invalid_blocks(kv_out.invalid_block_ids or set(), outputs)
        self._handle_finished_recving(
            kv_out.finished_recving or set(), kv_out.failed_recving or set(), outputs
        )
        for rid in kv_out.finished_sending or ():
            self._release_borrow(rid, _SEND)

        for rid in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished (e.g. aborted) or preempted since it was scheduled
            if rid in reset_ids:
                continue  # its KV is garbage; this step's sample is discarded
            output = self._update_request(request, scheduler_output, mro)
            if output is not None:
                outputs.append(output)
        return outputs

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

        if stop_status is None and new_tokens and self.num_spec_tokens:
            # Drafts continue the token just sampled; a prefill chunk has none to continue.
            proposed = _row(mro.spec_token_ids, index)
            request.spec_token_ids = list(proposed[: self._max_drafts(request)])
        # Only KV of computed, verified positions is published.
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)

        logits = None
        if request.sampling_params.return_logits and new_tokens:
            rows = mro.sampled_logits.get(rid)
            if rows is not None:
                logits = rows[: len(new_tokens)]
        if stop_status is not None:
            return dataclasses.replace(
                self._finish(request, stop_status),
                new_token_ids=tuple(new_tokens),
                logits=logits,
                num_draft_tokens=len(drafts),
                num_accepted_tokens=num_accepted,
            )
        if not new_tokens:
            return None
        return EngineCoreOutput(
            req_id=rid,
            new_token_ids=tuple(new_tokens),
            logits=logits,
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

    # ------------------------------------------------------------------ connector results

    def _handle_invalid_blocks(
        self, invalid: set[int], outputs: list[EngineCoreOutput]
    ) -> set[str]:
        """Apply the load-failure policy to running requests holding invalid blocks; flag
        in-flight loads. Returns the ids of running requests reset for recompute."""
        if not invalid:
            return set()
        bm = self.block_manager
        bm.evict_blocks(sorted(invalid))
        for request in self._loading.values():
            if invalid.intersection(bm.get_block_ids(request.request_id)):
                request.load_failed = True
        reset: set[str] = set()
        for request in list(self._running):
            table = bm.get_block_ids(request.request_id)
            bad = [i for i, b in enumerate(table) if b in invalid]
            if not bad:
                continue
            if self.kv_load_failure_policy == "fail":
                outputs.append(self._fail_load(request))
                continue
            request.num_computed_tokens = min(request.num_cached_tokens, bad[0] * bm.block_size)
            request.spec_token_ids.clear()
            request.skip_connector = True
            reset.add(request.request_id)
        return reset

    def _handle_finished_recving(
        self, finished: set[str], failed: set[str], outputs: list[EngineCoreOutput]
    ) -> None:
        bm = self.block_manager
        resumed: list[Request] = []
        for rid in sorted(finished):
            if rid in self._borrows:
                self._release_borrow(rid, _RECV)
                continue
            request = self._loading.pop(rid, None)
            if request is None:
                continue  # a report about a request this scheduler is not loading
            # The load borrow ends here, whatever happens to the request next.
            request.status = RequestStatus.WAITING
            if rid in failed or request.load_failed:
                if self.kv_load_failure_policy == "fail":
                    outputs.append(self._fail_load(request))
                    continue
                table = bm.get_block_ids(rid)
                local_blocks = request.num_cached_tokens // bm.block_size
                bm.evict_blocks(table[local_blocks:])
                request.num_computed_tokens = request.num_cached_tokens
                request.skip_connector = True
            else:
                loaded = request.num_cached_tokens + request.num_external_tokens
                request.num_computed_tokens = min(loaded, request.num_tokens - 1)
                bm.cache_full_blocks(request, request.num_computed_tokens)
            request.num_external_tokens = 0
            request.load_failed = False
            request.admitted = True
            resumed.append(request)
        # Loaded requests already hold blocks: serve them before anything else that waits.
        resumed.sort(key=lambda r: r.arrival_order)
        self._waiting.extendleft(reversed(resumed))

    def _fail_load(self, request: Request) -> EngineCoreOutput:
        return self._finish(
            request,
            RequestStatus.FINISHED_ERROR,
            f"KV load failed for request {request.request_id} (kv_load_failure_policy=fail)",
        )

    def _release_borrow(self, rid: str, kind: str) -> None:
        borrows = self._borrows.get(rid)
        if borrows is None or kind not in borrows:
            return
        borrows.discard(kind)
        if not borrows:
            del self._borrows[rid]
            self.block_manager.free(rid)

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
        if self.connector is not None:
            blocks = self.block_manager.get_block_ids(rid)
            try:
                delay_free, params = self._check_finished_answer(
                    request, self._call_connector(request, "request_finished", request, blocks)
                )
            except KVConnectorHookError as exc:
                status, error = RequestStatus.FINISHED_ERROR, str(exc)
        request.status = status
        request.error = error
        borrows = set()
        if was_loading:
            borrows.add(_RECV)
        if delay_free:
            borrows.add(_SEND)
        if borrows and self.block_manager.holds_blocks(rid):
            self._borrows[rid] = borrows
        else:
            self.block_manager.free(rid)
        return EngineCoreOutput(
            req_id=rid,
            finished=True,
            finish_reason=status.finish_reason,
            error=error,
            kv_transfer_params=params,
        )

    def _check_finished_answer(self, request: Request, answer: Any) -> tuple[bool, Any]:
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise KVConnectorHookError(
                f"KV connector {type(self.connector).__name__}.request_finished returned "
                f"{answer!r} for request {request.request_id}, expected (delay_free, "
                "kv_transfer_params)"
            )
        return bool(answer[0]), answer[1]

    def _remove_from_queues(self, request: Request) -> None:
        rid = request.request_id
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._loading.pop(rid, None)
        elif request in self._waiting:
            self._waiting.remove(request)


def _row(rows: Sequence[Sequence[int]], index: int | None) -> Sequence[int]:
    if index is None or index >= len(rows):
        return ()
    return rows[index]
