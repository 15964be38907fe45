"""A request as the scheduler sees it, and what the scheduler reports back per request per step.

`Request` lives only in the scheduler process; workers keep a mirror built from
`SchedulerOutput` (see `scheduler_output.py`). It satisfies the connector's `KVRequest`
protocol, so scheduler-role connector hooks receive it directly.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.timeline import BOOK, now_ns, wall_clock

if TYPE_CHECKING:
    import torch

    from kvtransfer.engine.outputs import TokenLogprobs


# Steps after the first token put on a request's timeline (`engine.step`): enough to show a
# decode's pace, bounded so that a long generation costs its timeline a fixed number of spans.
TIMELINE_STEPS = 16


class DuplicateRequestError(ValueError):
    """A request id that is still in use (running, or its blocks still lent)."""


class PromptTooLargeError(ValueError):
    """A prompt that can never fit this engine's block pool."""


class RequestStatus(enum.Enum):
    """Where a request is. Only ``WAITING_FOR_REMOTE_KVS``, ``WAITING_WITH_KV`` and
    ``RUNNING`` hold blocks; a finished request's blocks may stay lent to the connector
    (`KVTransferState`), but the request itself is gone from the scheduler.

    WAITING --admit--> RUNNING, or --async load--> WAITING_FOR_REMOTE_KVS --load ends-->
    WAITING_WITH_KV --admit--> RUNNING --preempt--> PREEMPTED --admit--> RUNNING ...;
    any of them --> FINISHED_*.
    """

    WAITING = "waiting"
    # Holds blocks while a connector loads its KV asynchronously (`Request.kv_load`); scheduled
    # 0 tokens.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    # Holds blocks with its KV in place (loaded, or reset to its local prefix after a failed
    # load under "recompute"); admitted without asking the connector again.
    WAITING_WITH_KV = "waiting_with_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` for finished states, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class KVLoad:
    """A connector's asynchronous load into a parked request's blocks."""

    # Tokens it brings in, past the request's locally cached ones.
    num_external_tokens: int
    started_at: float
    # Started before the request's first tokens arrived (it overlaps its remote prefill).
    overlaps_prefill: bool
    # A block it writes was reported invalid; acted on when the load ends.
    failed: bool = False


@dataclass(eq=False)
class Request:
    """One generation request: its tokens, progress and scheduling state.

    ``num_computed_tokens`` counts positions whose KV is in the request's blocks (the scheduler
    advances it when it schedules a step and rolls back rejected draft tokens afterwards).
    ``spec_token_ids`` are the drafts to verify in the next step; they are not part of
    ``all_token_ids`` until accepted.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    seed: int
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    spec_token_ids: list[int] = field(default_factory=list)
    # Tokens served from the local prefix cache at the latest admission.
    num_cached_tokens: int = 0
    error: str | None = None
    # FCFS position, assigned by the scheduler when the request is added.
    arrival_order: int = -1
    # Overrides the scheduler's model-wide EOS for this request when set.
    eos_token_id: int | None = None
    # Its first output tokens come from elsewhere, later (`Scheduler.continue_request`): it may
    # load KV meanwhile but is not computed until then.
    awaits_generated: bool = False

    # ---- scheduler bookkeeping (never sent to workers) ----
    # How many of all_token_ids the workers already hold (the rest go in new_token_ids).
    num_synced_tokens: int = 0
    # Not states but facts the scheduler keeps: whether the workers hold a mirror of it (from
    # a NewRequestData; lost on preemption), and whether the "recompute" load-failure policy
    # took it away from the connector for good.
    known_to_workers: bool = False
    skip_connector: bool = False
    # The asynchronous load in flight: set exactly while WAITING_FOR_REMOTE_KVS.
    kv_load: KVLoad | None = None
    # What connector loads did for this request, reported with its final output.
    kv_stats: RequestKVStats = field(default_factory=lambda: RequestKVStats())
    # When `Scheduler.continue_request` gave it its first tokens (None: not yet, or never
    # awaited).
    continued_at: float | None = None
    # `time.monotonic` instants for `RequestTimings`: queued, first given tokens, first sampled.
    arrived_at: float | None = None
    first_scheduled_at: float | None = None
    first_sampled_at: float | None = None
    # The latest sample (wall clock, ns) and how many steps after the first are on its
    # timeline (at most TIMELINE_STEPS).
    last_sampled_ns: int | None = None
    num_timeline_steps: int = 0

    def timings(self) -> RequestTimings:
        """The phases so far (``queue_s`` excludes time parked for a KV load)."""
        now = time.monotonic()
        arrived = self.arrived_at if self.arrived_at is not None else now
        scheduled = self.first_scheduled_at if self.first_scheduled_at is not None else now
        compute = 0.0
        if self.first_scheduled_at is not None and self.first_sampled_at is not None:
            compute = self.first_sampled_at - self.first_scheduled_at
        queue = max(0.0, scheduled - arrived - self.kv_stats.load_wait_s)
        return RequestTimings(queue_s=queue, compute_s=compute)

    def record_sampled(self, num_tokens: int) -> None:
        """A step sampled ``num_tokens`` of it: the first such step puts its queue and compute
        phases on its timeline (`record_first_token`), each of the next TIMELINE_STEPS an
        ``engine.step`` span from the previous sample to this one."""
        if self.first_sampled_at is not None and self.num_timeline_steps >= TIMELINE_STEPS:
            return
        now = now_ns()
        if self.first_sampled_at is None:
            self.first_sampled_at = time.monotonic()
            self.record_first_token()
        elif self.last_sampled_ns is not None:
            self.num_timeline_steps += 1
            BOOK.record(
                self.request_id,
                "engine.step",
                self.last_sampled_ns,
                now,
                step=self.num_timeline_steps,
                tokens=num_tokens,
            )
        self.last_sampled_ns = now

    def record_first_token(self) -> None:
        """Put its queue and compute phases on its timeline (`kvtransfer.timeline`), once its
        first token was sampled here."""
        if self.first_sampled_at is None:
            return
        to_wall = wall_clock()
        sampled = to_wall(self.first_sampled_at)
        scheduled = to_wall(self.first_scheduled_at) if self.first_scheduled_at else sampled
        if self.arrived_at is not None:
            BOOK.record(self.request_id, "engine.queue", to_wall(self.arrived_at), scheduled)
        BOOK.record(
            self.request_id,
            "engine.compute",
            scheduled,
            sampled,
            cached_tokens=self.num_cached_tokens,
            prompt_tokens=self.num_prompt_tokens,
        )

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        self.prompt_token_ids = tuple(int(t) for t in self.prompt_token_ids)
        self._all_token_ids: list[int] = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs; treat as read-only (use `append_output_token`)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def extend_output_tokens(self, token_ids: Iterable[int]) -> None:
        for token_id in token_ids:
            self.append_output_token(token_id)


@dataclass
class RequestKVStats:
    """Per-request KV transfer accounting (cumulative over the request's loads).

    ``num_loaded_tokens``/``num_loaded_blocks``: prompt KV a connector brought in (not
    computed here); ``num_recomputed_tokens``: tokens whose load failed and that were computed
    locally instead; ``load_wait_s``: time spent parked in ``WAITING_FOR_REMOTE_KVS``.
    """

    num_loaded_tokens: int = 0
    num_loaded_blocks: int = 0
    num_recomputed_tokens: int = 0
    load_wait_s: float = 0.0
    # Of load_wait_s, the part before the request's first token arrived from elsewhere: the
    # load ran while its prefill still computed (`Request.awaits_generated`).
    overlapped_s: float = 0.0


@dataclass(frozen=True)
class RequestTimings:
    """Where a request's time to its first token went on this engine.

    ``queue_s``: queued until first given tokens to compute, time parked for a KV load
    excluded (`RequestKVStats.load_wait_s` holds that); ``compute_s``: from then until its
    first token was sampled (a prefill's compute; a decode's first step).
    """

    queue_s: float = 0.0
    compute_s: float = 0.0


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one request produced in one step (or how it ended).

    ``logits`` holds the ``sampled_logits`` rows of ``new_token_ids`` (only when the request
    asked for them). ``num_draft_tokens``/``num_accepted_tokens`` describe this step's
    speculative verification (0/0 without drafts).
    """

    req_id: str
    new_token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    logits: torch.Tensor | None = None
    # With SamplingParams.logprobs: one entry per token of new_token_ids.
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # On the final output: prompt tokens served from the local prefix cache, and loads.
    # Measurements, so equality of outputs ignores them.
    num_cached_tokens: int = field(default=0, compare=False)
    kv_stats: RequestKVStats | None = field(default=None, compare=False)
    timings: RequestTimings | None = field(default=None, compare=False)
