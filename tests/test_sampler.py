"""The sampler: greedy ties, top-k/top-p filtering, (seed, position)-keyed randomness, and that
random rows follow the filtered softmax distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvtransfer.engine.runner.sampler import compute_probs, exponential_noise, noise_seed, sample
from kvtransfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
T1 = SamplingParams(temperature=1.0)
# Chi-square critical value for 7 degrees of freedom at p = 0.001 (8-token vocabulary).
CHI2_7DOF_P001 = 24.322


def _sample_one(row: list[float], params: SamplingParams, seed: int, position: int) -> int:
    return int(sample(torch.tensor([row]), [params], [seed], [position])[0])


def _draws(row: list[float], params: SamplingParams, seed: int, n: int) -> torch.Tensor:
    logits = torch.tensor([row]).expand(n, -1)
    return sample(logits, [params] * n, [seed] * n, list(range(n)))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    support = expected > 0
    return float((((counts[support] - expected[support]) ** 2) / expected[support]).sum())


def test_greedy_takes_argmax_and_breaks_ties_by_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    tokens = sample(logits, [GREEDY] * 3, [1, 2, 3], [0, 0, 0])
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == [1, 0, 2]


def test_greedy_ignores_seed_and_position():
    row = [0.5, 2.5, -1.0, 2.0]
    assert {_sample_one(row, GREEDY, seed, pos) for seed in range(5) for pos in range(5)} == {1}


def test_top_k_one_equals_greedy_even_on_ties():
    row = [0.0, 4.0, 1.0, 4.0, 3.9]
    top1 = SamplingParams(temperature=1.5, top_k=1)
    assert {_sample_one(row, top1, seed, pos) for seed in range(10) for pos in range(20)} == {1}
    assert compute_probs(torch.tensor(row), top1).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_tiny_top_p_equals_greedy_even_on_ties():
    row = [0.0, 4.0, 1.0, 4.0, 3.9]
    nucleus = SamplingParams(temperature=2.0, top_p=1e-6)
    assert {_sample_one(row, nucleus, seed, pos) for seed in range(10) for pos in range(20)} == {1}


def test_compute_probs_greedy_is_one_hot_on_lowest_max():
    probs = compute_probs(torch.tensor([1.0, 7.0, 7.0]), GREEDY)
    assert probs.dtype == torch.float32
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_compute_probs_applies_temperature():
    row = torch.tensor([0.0, math.log(3.0)])
    # At T = 0.5 the odds 3:1 become 9:1.
    assert compute_probs(row, SamplingParams(temperature=0.5)).tolist() == pytest.approx([0.1, 0.9])


def test_compute_probs_top_k_keeps_exactly_k_lowest_ids_on_ties():
    probs = compute_probs(torch.tensor([1.0, 0.0, 0.0, 0.0]), SamplingParams(1, 1.0, top_k=2))
    e = math.e
    assert probs.tolist() == pytest.approx([e / (e + 1), 1 / (e + 1), 0.0, 0.0])


def test_compute_probs_top_p_keeps_smallest_prefix_reaching_the_mass():
    row = torch.tensor([0.125, 0.5, 0.25, 0.125]).log()
    probs = compute_probs(row, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs.tolist() == pytest.approx([0.0, 2 / 3, 1 / 3, 0.0])
    # Tokens 0 and 3 tie for the third place: the lower id is kept.
    probs = compute_probs(row, SamplingParams(temperature=1.0, top_p=0.8))
    assert probs.tolist() == pytest.approx([1 / 7, 4 / 7, 2 / 7, 0.0])


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # After top-k=2: [4/7, 3/7]; 4/7 < 0.6 so the second token stays.
    probs = compute_probs(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert probs.tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, top_p=1e-9),
        SamplingParams(temperature=1e-4, top_p=1e-9),
        SamplingParams(temperature=50.0, top_k=3, top_p=0.01),
        SamplingParams(temperature=0.3, top_k=100),
    ],
)
def test_filtering_never_leaves_zero_tokens(params):
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(20, 50, generator=generator) * 30
    rows[0] = float("-inf")
    rows[0, 17] = -1e30
    for row in rows:
        probs = compute_probs(row, params)
        assert int((probs > 0).sum()) >= 1
        assert float(probs.sum()) == pytest.approx(1.0)
    tokens = sample(rows, [params] * 20, list(range(20)), [3] * 20)
    assert tokens[0] == 17
    assert all(compute_probs(rows[i], params)[t] > 0 for i, t in enumerate(tokens.tolist()))


def test_same_seed_and_position_give_the_same_token():
    row = [0.0] * 8
    first = [_sample_one(row, T1, 42, pos) for pos in range(50)]
    again = [_sample_one(row, T1, 42, pos) for pos in range(50)]
    assert first == again
    # Uniform over 8 tokens: 50 positions cover every token, so the position does change draws.
    assert set(first) == set(range(8))


def test_different_seeds_give_different_streams():
    row = [0.0] * 8
    a = _draws(row, T1, 1, 64).tolist()
    b = _draws(row, T1, 2, 64).tolist()
    assert a != b
    # Seed s must not replay seed s + 1 shifted by a position.
    assert a[1:] != b[:-1]


def test_noise_seed_is_63_bit_and_keyed_by_both_inputs():
    seeds = {noise_seed(s, p) for s in (-1, 0, 1, 2**63 + 5) for p in range(100)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert noise_seed(5, 9) == noise_seed(5, 9)


def test_exponential_noise_is_reproducible_and_positive():
    a = exponential_noise(3, 11, 1000)
    b = exponential_noise(3, 11, 1000, torch.Generator().manual_seed(999))
    assert a.dtype == torch.float64
    assert torch.equal(a, b)
    assert bool((a > 0).all())
    assert float(a.mean()) == pytest.approx(1.0, abs=0.1)


def test_empirical_distribution_matches_tempered_softmax():
    row = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]
    params = SamplingParams(temperature=0.7)
    tokens = _draws(row, params, 1234, 20_000)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(torch.tensor(row, dtype=torch.float64) / 0.7, dim=0)
    assert _chi_square(counts, expected) < CHI2_7DOF_P001


def test_empirical_distribution_matches_filtered_probs():
    row = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]
    params = SamplingParams(temperature=1.3, top_k=5, top_p=0.8)
    expected = compute_probs(torch.tensor(row), params)
    tokens = _draws(row, params, 99, 20_000)
    counts = torch.bincount(tokens, minlength=8).double()
    assert (counts > 0).tolist() == (expected > 0).tolist()
    support = int((expected > 0).sum())
    assert support == 4
    # 3 degrees of freedom at p = 0.001.
    assert _chi_square(counts, expected) < 16.266


def test_a_row_samples_the_same_alone_or_in_any_batch():
    vocab = 32
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, vocab, generator=generator)
    params = [
        SamplingParams(temperature=0.8),
        GREEDY,
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.5),
        SamplingParams(temperature=2.0),
    ]
    seeds = [11, 12, 13, 14, 15, 16]
    positions = [5, 9, 0, 200, 7, 31]
    alone = [
        int(sample(rows[i : i + 1], [params[i]], [seeds[i]], [positions[i]])[0]) for i in range(6)
    ]
    batched = sample(rows, params, seeds, positions).tolist()
    assert batched == alone
    order = [4, 0, 5, 2, 1, 3]
    shuffled = sample(
        rows[order],
        [params[i] for i in order],
        [seeds[i] for i in order],
        [positions[i] for i in order],
    ).tolist()
    assert shuffled == [alone[i] for i in order]


def test_empty_batch_gives_empty_tokens():
    tokens = sample(torch.zeros(0, 5), [], [], [])
    assert tokens.dtype == torch.int64
    assert tokens.shape == (0,)


def test_rejects_malformed_inputs():
    with pytest.raises(
        ValueError, match=r"logits must be 2-D \[num_rows, vocab\], got shape \(4,\)"
    ):
        sample(torch.zeros(4), [GREEDY], [0], [0])
    with pytest.raises(ValueError, match="params has 1 entries for 2 rows of logits"):
        sample(torch.zeros(2, 4), [GREEDY], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="seeds has 3 entries for 2 rows of logits"):
        sample(torch.zeros(2, 4), [GREEDY] * 2, [0, 0, 0], [0, 0])
    with pytest.raises(ValueError, match="output_positions has 1 entries for 2 rows of logits"):
        sample(torch.zeros(2, 4), [GREEDY] * 2, [0, 0], [0])
    with pytest.raises(ValueError, match="output_position must be >= 0, got -1"):
        sample(torch.zeros(1, 4), [T1], [0], [-1])
    with pytest.raises(ValueError, match=r"logits_row must be 1-D, got shape \(1, 4\)"):
        compute_probs(torch.zeros(1, 4), T1)
    with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
        exponential_noise(0, 0, 0)
