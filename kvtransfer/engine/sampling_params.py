"""`SamplingParams`: how one request picks its next tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass

# The most alternatives per position a request may ask log-probabilities for.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` is greedy. Randomness is keyed by ``(seed, position)``, so a seeded
    request yields the same tokens whatever it is batched with, preempted or speculated; a
    request without a seed gets one drawn by the engine when it is added."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Return the logits of every sampled position (tests compare them with a dense forward).
    return_logits: bool = False
    # Log-probabilities of each output token and of the `logprobs` most likely tokens at its
    # position (raw model distribution: log-softmax of the logits, before temperature).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
