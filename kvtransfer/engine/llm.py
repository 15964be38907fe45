"""`LLM`: offline generation — add every prompt, step until all finished, return the outputs."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.executor.executor import DEFAULT_WORKER
from kvtransfer.engine.model.loader import load_tokenizer
from kvtransfer.engine.outputs import TokenLogprobs
from kvtransfer.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    logits: torch.Tensor | None = None
    # With SamplingParams.logprobs: one entry per token of token_ids.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class LLM:
    def __init__(self, config: EngineConfig | None = None, worker_cls: str = DEFAULT_WORKER):
        self.config = config or EngineConfig()
        self.tokenizer = load_tokenizer(self.config.model)
        self.engine = EngineCore(self.config, worker_cls)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        transfer = list(kv_transfer_params or [None] * len(prompts))
        if not len(per_prompt) == len(transfer) == len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(per_prompt)} sampling params and "
                f"{len(transfer)} kv_transfer_params; they must match"
            )

        outputs: dict[str, RequestOutput] = {}
        try:
            for prompt, sp, kv_params in zip(prompts, per_prompt, transfer, strict=True):
                request_id = f"gen-{next(self._ids)}"
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                outputs[request_id] = RequestOutput(request_id, list(token_ids))
                self.engine.add_request(request_id, token_ids, sp, kv_params)
            unfinished = set(outputs)
            while unfinished:
                for step_output in self.engine.step():
                    output = outputs.get(step_output.req_id)
                    if output is None:
                        continue  # a request of an earlier call finishing late
                    self._merge(output, step_output)
                    if step_output.finished:
                        unfinished.discard(step_output.req_id)
                self.engine.wait_if_idle()
        except BaseException:
            self.engine.abort_request([r for r, o in outputs.items() if o.finish_reason is None])
            raise
        for output in outputs.values():
            output.text = self.tokenizer.decode(output.token_ids)
        return list(outputs.values())

    @staticmethod
    def _merge(output: RequestOutput, step_output: Any) -> None:
        output.token_ids.extend(step_output.new_token_ids)
        output.logprobs.extend(step_output.logprobs)
        output.num_draft_tokens += step_output.num_draft_tokens
        output.num_accepted_tokens += step_output.num_accepted_tokens
        if step_output.logits is not None:
            output.logits = (
                step_output.logits
                if output.logits is None
                else torch.cat([output.logits, step_output.logits])
            )
        if step_output.finished:
            output.finish_reason = step_output.finish_reason
            output.error = step_output.error
            output.kv_transfer_params = step_output.kv_transfer_params

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
