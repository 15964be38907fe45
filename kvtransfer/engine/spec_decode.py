"""Speculative decoding helpers: verifying drafts, the n-gram (prompt lookup) proposer, and the
acceptance-rate bookkeeping the CLI and benchmark report.

Verification is sample-and-compare: the target model samples its own token at every verified
position (the sampler's randomness is keyed by position, so that token is exactly what plain
decoding would have produced there) and a draft is accepted while it equals that token. For
greedy requests this is the usual exact-match rule; for random sampling the output keeps the
target's distribution, at the price of a lower acceptance rate than rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def accept_draft_tokens(
    draft_token_ids: Sequence[int], target_token_ids: Sequence[int]
) -> list[int]:
    """The tokens a verification step emits: the accepted drafts, then the target's own token.

    ``target_token_ids[j]`` is the target's token at the position of ``draft_token_ids[j]``; the
    extra last entry is the bonus token following the final draft. The result always holds at
    least one token (``len(result) - 1`` drafts were accepted).
    """
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"need len(draft_token_ids) + 1 target tokens, got {len(target_token_ids)} for "
            f"{len(draft_token_ids)} draft tokens"
        )
    accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        accepted += 1
    return [int(t) for t in target_token_ids[: accepted + 1]]


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the history's suffix.

    Longer suffixes are tried first (``prompt_lookup_max`` down to ``prompt_lookup_min``): a
    longer match is stronger evidence that the continuation repeats too.
    """

    def __init__(
        self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_proposals: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_proposals)`` draft tokens; ``[]`` if the
        suffix never occurred before (or the budget is 0). Fewer tokens come back when the
        history ends before the budget is filled."""
        if max_proposals < 0:
            raise ValueError(f"max_proposals must be >= 0, got {max_proposals}")
        budget = min(self.num_speculative_tokens, max_proposals)
        if budget == 0:
            return []
        history = np.asarray(token_ids, dtype=np.int64)
        length = history.shape[0]
        for n in range(self.prompt_lookup_max, self.prompt_lookup_min - 1, -1):
            # An earlier occurrence starts before ``length - n``; windows over history[:-1]
            # are exactly those starts, and each is followed by at least one token.
            if length < n + 1:
                continue
            windows = sliding_window_view(history[:-1], n)
            starts = np.flatnonzero((windows == history[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return history[follow : follow + budget].tolist()
        return []


def acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    """Accepted draft tokens over proposed draft tokens (bonus tokens not counted); 0.0 when
    nothing was proposed."""
    if num_draft_tokens < 0 or num_accepted_tokens < 0:
        raise ValueError(
            f"token counts must be >= 0, got num_draft_tokens={num_draft_tokens}, "
            f"num_accepted_tokens={num_accepted_tokens}"
        )
    if num_accepted_tokens > num_draft_tokens:
        raise ValueError(
            f"num_accepted_tokens ({num_accepted_tokens}) exceeds num_draft_tokens "
            f"({num_draft_tokens})"
        )
    if num_draft_tokens == 0:
        return 0.0
    return num_accepted_tokens / num_draft_tokens


@dataclass
class SpecDecodeStats:
    """Running totals over verification steps (one `record` per request per step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        # Validates the pair exactly as the rate would, before the totals change.
        acceptance_rate(num_draft_tokens, num_accepted_tokens)
        if num_draft_tokens:
            self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_draft_tokens, self.num_accepted_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per draft on average (accepted drafts plus the target's own token);
        0.0 before any draft."""
        if self.num_drafts == 0:
            return 0.0
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts
