"""The worker's mirror of the requests it runs: tokens, block table, computed-token count.

Nothing here counts on its own. Every step the scheduler's `SchedulerOutput` overwrites
``num_computed_tokens`` and delivers every new token, so speculative rejections or preemptions
on the scheduler side can never make the mirror drift (vLLM PR #42202).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler_output import SchedulerOutput


@dataclass
class RequestState:
    req_id: str
    prompt_len: int
    sampling_params: SamplingParams
    seed: int
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # One table per KV cache group after group 0 (a hybrid model's sliding-window layers).
    window_block_ids: list[list[int]] = field(default_factory=list)


class RequestStates:
    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, req_id: str) -> RequestState:
        return self._states[req_id]

    def req_ids(self) -> list[str]:
        return list(self._states)

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the mirror to the state the scheduler describes for this step."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._states.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._states[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_len=new.prompt_len,
                sampling_params=new.sampling_params,
                seed=new.seed,
                token_ids=list(new.token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                window_block_ids=[list(table) for table in new.window_block_ids],
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self._states.get(cached.req_id)
            if state is None:
                raise RuntimeError(
                    f"scheduler sent an update for request {cached.req_id!r} this worker never "
                    "received (scheduler and worker out of sync)"
                )
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            for table, new_ids in zip(
                state.window_block_ids, cached.new_window_block_ids, strict=True
            ):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def num_computed_tokens(self, req_ids: list[str]) -> np.ndarray:
        return np.array([self._states[r].num_computed_tokens for r in req_ids], dtype=np.int64)

    def is_prefilling(self, req_ids: list[str], num_new_known_tokens: np.ndarray) -> np.ndarray:
        """Per request: after computing ``num_new_known_tokens`` more of its known tokens (draft
        tokens excluded), are some still uncomputed? Such a request (a chunked prefill, or a
        resumed request catching up) samples nothing this step."""
        computed_after = self.num_computed_tokens(req_ids) + num_new_known_tokens
        num_tokens = np.array([len(self._states[r].token_ids) for r in req_ids], dtype=np.int64)
        return computed_after < num_tokens
