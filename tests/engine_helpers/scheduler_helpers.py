"""A scripted model runner and a scripted connector for testing `Scheduler` in isolation.

`ScriptedRunner` plays every worker at once. It keeps the same request mirror a worker keeps
(built only from `SchedulerOutput`s), checks each output against it and simulates the paged KV
cache: every slot remembers which token history its KV was computed from, and before a step
every position the scheduler calls computed is checked against the request's real history. A
scheduler that trusts a failed load, forgets to roll back a rejected draft or serves a wrong
prefix-cache block therefore fails the test, not just a counter.

The "model" is a pure function of the token history, so a request yields the same tokens however
it is batched, chunked, preempted or speculated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import KVConnectorMetadata, KVConnectorRole, KVRequest
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.engine.config import EngineConfig, SpeculativeConfig
from kvtransfer.engine.outputs import ModelRunnerOutput
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler.request import EngineCoreOutput, Request
from kvtransfer.engine.scheduler.scheduler import Scheduler
from kvtransfer.engine.scheduler_output import SchedulerOutput

VOCAB = 64
BLOCK = 4
GARBAGE = "garbage"

Model = Callable[[Sequence[int]], int]
Drafter = Callable[[Sequence[int]], Sequence[int]]


def next_token(history: Sequence[int]) -> int:
    """The scripted model: a deterministic function of the whole token history."""
    return (history[-1] * 7 + len(history) * 3 + 1) % VOCAB


def kv_content(history: Sequence[int]) -> tuple[int, ...]:
    """What the KV at position ``len(history) - 1`` depends on: every token up to it."""
    return tuple(history)


def make_config(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
) -> EngineConfig:
    return EngineConfig(
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        speculative=speculative,
        kv_transfer_config=kv_transfer_config,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_model_len: int = 128,
    eos_token_id: int | None = None,
    connector: KVConnectorBase_V1 | None = None,
    **config_kwargs: Any,
) -> Scheduler:
    if connector is not None:
        config_kwargs.setdefault("kv_transfer_config", connector.kv_transfer_config)
    return Scheduler(
        make_config(**config_kwargs),
        num_blocks=num_blocks,
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        eos_token_id=eos_token_id,
        connector=connector,
    )


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    kv_transfer_params: dict[str, Any] | None = None,
    **params: Any,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        seed=0,
        kv_transfer_params=kv_transfer_params,
    )


def prompt_of(length: int, start: int = 1) -> list[int]:
    return [(start + i) % VOCAB for i in range(length)]


# ---------------------------------------------------------------------- connector


@dataclass(frozen=True)
class LoadSpec:
    """Load positions ``[start, end)`` of ``token_ids`` into ``block_ids`` (worker side)."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int
    is_async: bool


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    step: int
    loads: tuple[LoadSpec, ...] = ()


class ScriptedConnector(KVConnectorBase_V1):
    """Scheduler half of a connector whose answers the test scripts per request id."""

    def __init__(self, policy: str = "fail") -> None:
        super().__init__(
            KVTransferConfig(
                kv_connector="ScriptedConnector",
                kv_role="kv_both",
                kv_load_failure_policy=policy,
            ),
            KVConnectorRole.SCHEDULER,
        )
        # Per request, the answers get_num_new_matched_tokens gives in turn (last one repeats).
        self.matches: dict[str, list[tuple[int | None, bool]]] = {}
        self.finish_answers: dict[str, tuple[bool, dict[str, Any] | None]] = {}
        # hook name -> request ids for which that hook raises.
        self.raise_for: dict[str, set[str]] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.num_build_calls = 0
        self.connector_outputs: list[KVConnectorOutput] = []
        self._local: dict[str, int] = {}
        self._async: dict[str, bool] = {}
        self._pending: list[LoadSpec] = []

    def _maybe_raise(self, hook: str, request: KVRequest) -> None:
        if request.request_id in self.raise_for.get(hook, ()):
            raise RuntimeError(f"{hook} exploded")

    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append(("match", request.request_id, num_computed_tokens))
        self._maybe_raise("get_num_new_matched_tokens", request)
        answers = self.matches.get(request.request_id)
        if not answers:
            return 0, False
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        self._local[request.request_id] = num_computed_tokens
        self._async[request.request_id] = answer[1]
        return answer

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self.calls.append(("alloc", rid, tuple(block_ids), num_external_tokens))
        self._maybe_raise("update_state_after_alloc", request)
        if num_external_tokens:
            start = self._local.get(rid, 0)
            self._pending.append(
                LoadSpec(
                    req_id=rid,
                    token_ids=tuple(request.prompt_token_ids),
                    block_ids=tuple(block_ids),
                    start=start,
                    end=start + num_external_tokens,
                    is_async=self._async[rid],
                )
            )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.num_build_calls += 1
        meta = ScriptedMetadata(step=self.num_build_calls, loads=tuple(self._pending))
        self._pending = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_outputs.append(connector_output)

    def request_finished(
        self, request: KVRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("finished", request.request_id, tuple(block_ids)))
        self._maybe_raise("request_finished", request)
        return self.finish_answers.get(request.request_id, (False, None))

    def hook_calls(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


# ---------------------------------------------------------------------- runner


@dataclass
class _Mirror:
    prompt_len: int
    tokens: list[int]
    blocks: list[int]
    num_computed: int
    return_logits: bool


@dataclass
class ScriptedRunner:
    """Every worker of the engine, scripted (see the module docstring)."""

    block_size: int = BLOCK
    model: Model = next_token
    drafter: Drafter | None = None
    num_lookahead: int = 0
    mirrors: dict[str, _Mirror] = field(default_factory=dict)
    kv: dict[int, Any] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    _inflight: dict[str, LoadSpec] = field(default_factory=dict)
    _next_kv_output: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    _sync_invalid: dict[str, Sequence[int]] = field(default_factory=dict)

    def _slot(self, blocks: Sequence[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _write(self, load: LoadSpec, skip_blocks: Sequence[int] = ()) -> None:
        for pos in range(load.start, load.end):
            block = load.block_ids[pos // self.block_size]
            content = GARBAGE if block in skip_blocks else kv_content(load.token_ids[: pos + 1])
            self.kv[self._slot(load.block_ids, pos)] = content

    # -- the test drives transfers with these; reports go out with the next execute()

    def finish_load(
        self, req_id: str, *, failed: bool = False, invalid_blocks: Sequence[int] = ()
    ) -> None:
        load = self._inflight.pop(req_id)
        self._write(load, load.block_ids if failed else invalid_blocks)
        out = self._next_kv_output
        out.finished_recving = (out.finished_recving or set()) | {req_id}
        if failed:
            out.failed_recving = (out.failed_recving or set()) | {req_id}
        if invalid_blocks:
            out.invalid_block_ids = (out.invalid_block_ids or set()) | set(invalid_blocks)

    def finish_send(self, req_id: str) -> None:
        out = self._next_kv_output
        out.finished_sending = (out.finished_sending or set()) | {req_id}

    def report_invalid_blocks(self, block_ids: Sequence[int]) -> None:
        out = self._next_kv_output
        out.invalid_block_ids = (out.invalid_block_ids or set()) | set(block_ids)

    # -- one step

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        self._apply(so)
        self._run_loads(so)
        req_ids: list[str] = []
        sampled_rows: list[list[int]] = []
        spec_rows: list[list[int]] = []
        logits: dict[str, torch.Tensor] = {}
        for rid, num_new in so.num_scheduled_tokens.items():
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            sampled = self._forward(rid, num_new, drafts)
            req_ids.append(rid)
            sampled_rows.append(sampled)
            history = self.mirrors[rid].tokens + sampled
            spec_rows.append(list(self.drafter(history)) if sampled and self.drafter else [])
            if sampled and self.mirrors[rid].return_logits:
                logits[rid] = torch.nn.functional.one_hot(
                    torch.tensor(sampled), num_classes=VOCAB
                ).float()
        self._sync_invalid.clear()
        kv_out, self._next_kv_output = self._next_kv_output, KVConnectorOutput()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled_rows,
            spec_token_ids=spec_rows,
            sampled_logits=logits,
            kv_connector_output=None if kv_out.is_empty() else kv_out,
        )

    def _apply(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.mirrors.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.mirrors:
                raise AssertionError(f"{new.req_id} sent as new while workers hold it")
            self.mirrors[new.req_id] = _Mirror(
                prompt_len=new.prompt_len,
                tokens=list(new.token_ids),
                blocks=list(new.block_ids),
                num_computed=new.num_computed_tokens,
                return_logits=new.sampling_params.return_logits,
            )
        for cached in so.scheduled_cached_reqs:
            mirror = self.mirrors[cached.req_id]
            mirror.tokens.extend(cached.new_token_ids)
            mirror.blocks.extend(cached.new_block_ids)
            mirror.num_computed = cached.num_computed_tokens
        scheduled = {r.req_id for r in so.scheduled_new_reqs} | {
            r.req_id for r in so.scheduled_cached_reqs
        }
        if scheduled != set(so.num_scheduled_tokens):
            raise AssertionError(
                f"scheduled requests {sorted(scheduled)} != {sorted(so.num_scheduled_tokens)}"
            )

    def _run_loads(self, so: SchedulerOutput) -> None:
        meta = so.kv_connector_metadata
        for load in meta.loads if isinstance(meta, ScriptedMetadata) else ():
            if load.is_async:
                self._inflight[load.req_id] = load
            else:
                self._write(load, self._sync_invalid.get(load.req_id, ()))

    def fail_sync_load(self, req_id: str, block_ids: Sequence[int]) -> None:
        """The next synchronous load of ``req_id`` leaves ``block_ids`` garbage and says so."""
        self._sync_invalid[req_id] = tuple(block_ids)
        self.report_invalid_blocks(block_ids)

    def _forward(self, rid: str, num_new: int, drafts: list[int]) -> list[int]:
        mirror = self.mirrors[rid]
        tokens, start = mirror.tokens, mirror.num_computed
        seq = tokens + drafts
        end = start + num_new
        if end > len(seq) or len(drafts) != max(0, end - len(tokens)):
            raise AssertionError(
                f"{rid}: {num_new} tokens from {start} with {len(drafts)} drafts over "
                f"{len(tokens)} tokens"
            )
        if len(mirror.blocks) * self.block_size < end + self.num_lookahead:
            raise AssertionError(
                f"{rid}: {len(mirror.blocks)} blocks cannot hold {end} + {self.num_lookahead} slots"
            )
        # A synchronous load that failed this step leaves garbage the scheduler cannot know
        # about yet (it learns from this step's invalid_block_ids).
        known_bad = self._sync_invalid.get(rid, ())
        for pos in range(start):
            if mirror.blocks[pos // self.block_size] in known_bad:
                continue
            expected = kv_content(tokens[: pos + 1])
            if self.kv.get(self._slot(mirror.blocks, pos)) != expected:
                raise AssertionError(f"{rid}: KV at position {pos} is not valid")
        for pos in range(start, end):
            self.kv[self._slot(mirror.blocks, pos)] = kv_content(seq[: pos + 1])
        if end < len(seq):
            return []
        sampled = [self.model(tokens)]
        for draft in drafts:
            if draft != sampled[-1]:
                break
            sampled.append(self.model(tokens + sampled))
        # A draft model writes KV past the verified tokens; never valid for the scheduler.
        for pos in range(end, end + self.num_lookahead):
            self.kv[self._slot(mirror.blocks, pos)] = GARBAGE
        return sampled


# ---------------------------------------------------------------------- driving


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_outputs: int = 0


def step(
    scheduler: Scheduler, runner: ScriptedRunner
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, runner.execute(so))


def collect(results: dict[str, Result], outputs: Sequence[EngineCoreOutput]) -> None:
    for out in outputs:
        result = results.setdefault(out.req_id, Result())
        if result.finish_reason is not None:
            raise AssertionError(f"{out.req_id} produced output after finishing")
        result.tokens.extend(out.new_token_ids)
        result.num_outputs += 1
        if out.finished:
            result.finish_reason = out.finish_reason
            result.error = out.error
            result.kv_transfer_params = out.kv_transfer_params


def run_to_completion(
    scheduler: Scheduler,
    runner: ScriptedRunner,
    max_steps: int = 500,
    results: dict[str, Result] | None = None,
) -> dict[str, Result]:
    """Step until the scheduler has no pending work; outputs are added to ``results``."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not scheduler.has_pending_work():
            return results
        collect(results, step(scheduler, runner)[1])
    raise AssertionError(f"scheduler still has work after {max_steps} steps")


def reference_tokens(prompt: Sequence[int], max_tokens: int, model: Model = next_token) -> list:
    """What an unconstrained greedy run of the scripted model generates."""
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(model(history))
    return history[len(prompt) :]
