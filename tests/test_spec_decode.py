"""Speculative decoding helpers: sample-and-compare verification, the n-gram proposer and the
acceptance-rate bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.engine.runner.sampler import sample
from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    accept_draft_tokens,
    acceptance_rate,
)

pytestmark = pytest.mark.unit

# ----------------------------------------------------------------------------- verification


def test_all_drafts_accepted_adds_the_bonus_token():
    assert accept_draft_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]


def test_first_mismatch_stops_with_the_targets_token():
    assert accept_draft_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]


def test_mismatch_at_first_draft_emits_one_token():
    assert accept_draft_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]


def test_later_matches_after_a_mismatch_do_not_count():
    assert accept_draft_tokens([1, 2, 3, 4], [1, 0, 3, 4, 5]) == [1, 0]


def test_no_drafts_emits_the_target_token():
    assert accept_draft_tokens([], [3]) == [3]


def test_accepts_tensors_and_returns_python_ints():
    result = accept_draft_tokens(torch.tensor([4, 5]), torch.tensor([4, 5, 6]))
    assert result == [4, 5, 6]
    assert all(type(t) is int for t in result)


@pytest.mark.parametrize(("drafts", "targets"), [([1, 2], [1, 2]), ([1], [1, 2, 3]), ([], [])])
def test_target_length_must_be_one_more_than_drafts(drafts, targets):
    with pytest.raises(
        ValueError,
        match=rf"need len\(draft_token_ids\) \+ 1 target tokens, got {len(targets)} for "
        rf"{len(drafts)} draft tokens",
    ):
        accept_draft_tokens(drafts, targets)


def _toy_logits(context: list[int], vocab: int) -> torch.Tensor:
    """A deterministic stand-in for a model: logits depend on the last two tokens."""
    gen = torch.Generator().manual_seed(
        1000 * context[-1] + (context[-2] if len(context) > 1 else 0)
    )
    return torch.randn(vocab, generator=gen) * 2


def _plain_decode(prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + n:
        logits = _toy_logits(tokens, 16).unsqueeze(0)
        tokens.append(int(sample(logits, [params], [seed], [len(tokens)])[0]))
    return tokens[len(prompt) :]


def _speculative_decode(
    prompt: list[int], params: SamplingParams, seed: int, n: int, proposer: NgramProposer
) -> tuple[list[int], SpecDecodeStats]:
    tokens = list(prompt)
    stats = SpecDecodeStats()
    while len(tokens) < len(prompt) + n:
        drafts = proposer.propose(tokens, len(prompt) + n - len(tokens) - 1)
        # The target scores every draft position in one batch, as the model runner does.
        contexts = [tokens + drafts[:j] for j in range(len(drafts) + 1)]
        logits = torch.stack([_toy_logits(c, 16) for c in contexts])
        positions = [len(c) for c in contexts]
        targets = sample(logits, [params] * len(contexts), [seed] * len(contexts), positions)
        emitted = accept_draft_tokens(drafts, targets.tolist())
        stats.record(len(drafts), len(emitted) - 1)
        tokens.extend(emitted)
    return tokens[len(prompt) :], stats


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3)],
)
def test_speculation_emits_exactly_what_plain_decoding_emits(params):
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    proposer = NgramProposer(1, 3, 4)
    plain = _plain_decode(prompt, params, seed=77, n=40)
    speculative, stats = _speculative_decode(prompt, params, seed=77, n=40, proposer=proposer)
    assert speculative == plain
    # Some drafts were accepted and some rejected, so both paths of verification ran.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# ------------------------------------------------------------------------------ n-gram


def test_ngram_returns_tokens_after_the_earlier_occurrence():
    proposer = NgramProposer(2, 3, 3)
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]


def test_ngram_uses_the_most_recent_earlier_occurrence():
    proposer = NgramProposer(2, 2, 3)
    assert proposer.propose([1, 2, 9, 1, 2, 8, 1, 2], 3) == [8, 1, 2]


def test_ngram_prefers_longer_matches():
    history = [5, 1, 2, 7, 3, 1, 2, 8, 5, 1, 2]
    assert NgramProposer(2, 3, 3).propose(history, 3) == [7, 3, 1]
    assert NgramProposer(2, 2, 3).propose(history, 3) == [8, 5, 1]


def test_ngram_falls_back_to_shorter_suffixes():
    # [4, 2] and [9, 4, 2] never occurred before; [2] did, followed by 6.
    assert NgramProposer(1, 3, 2).propose([2, 6, 7, 9, 4, 2], 2) == [6, 7]


def test_ngram_returns_fewer_tokens_when_history_ends():
    assert NgramProposer(2, 2, 3).propose([7, 7, 7], 3) == [7]
    assert NgramProposer(1, 1, 5).propose([3, 4, 3], 5) == [4, 3]


def test_ngram_budget_is_min_of_config_and_max_proposals():
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(2, 2, 3).propose(history, 10) == [3, 4, 5]
    assert NgramProposer(2, 2, 3).propose(history, 2) == [3, 4]
    assert NgramProposer(2, 2, 3).propose(history, 0) == []


def test_ngram_without_a_match_proposes_nothing():
    proposer = NgramProposer(2, 4, 3)
    assert proposer.propose([1, 2, 3, 4, 5], 3) == []
    assert proposer.propose([1, 2], 3) == []
    assert proposer.propose([], 3) == []
    # The suffix itself is not an earlier occurrence.
    assert NgramProposer(1, 1, 3).propose([1], 3) == []


def test_ngram_returns_python_ints_on_long_histories():
    history = list(range(3000)) + list(range(10))
    result = NgramProposer(2, 4, 5).propose(history, 5)
    assert result == [10, 11, 12, 13, 14]
    assert all(type(t) is int for t in result)


def test_ngram_rejects_bad_arguments():
    with pytest.raises(
        ValueError, match="need 1 <= prompt_lookup_min <= prompt_lookup_max, got 3, 2"
    ):
        NgramProposer(3, 2, 1)
    with pytest.raises(
        ValueError, match="need 1 <= prompt_lookup_min <= prompt_lookup_max, got 0, 2"
    ):
        NgramProposer(0, 2, 1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        NgramProposer(1, 2, 0)
    with pytest.raises(ValueError, match="max_proposals must be >= 0, got -1"):
        NgramProposer(1, 2, 3).propose([1, 1], -1)


# ---------------------------------------------------------------------------------- stats


def test_acceptance_rate():
    assert acceptance_rate(0, 0) == 0.0
    assert acceptance_rate(4, 3) == 0.75
    assert acceptance_rate(5, 0) == 0.0
    with pytest.raises(
        ValueError,
        match="token counts must be >= 0, got num_draft_tokens=-1, num_accepted_tokens=0",
    ):
        acceptance_rate(-1, 0)
    with pytest.raises(ValueError, match=r"num_accepted_tokens \(3\) exceeds num_draft_tokens"):
        acceptance_rate(2, 3)


def test_spec_decode_stats_accumulate():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate == 0.0
    assert stats.mean_accepted_length == 0.0
    stats.record(3, 3)
    stats.record(3, 0)
    stats.record(0, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == 2.5
    with pytest.raises(ValueError, match=r"num_accepted_tokens \(2\) exceeds"):
        stats.record(1, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 3)
