"""Turn one step's logits into tokens, reproducibly.

Random rows use the exponential race: with ``E_v ~ Exp(1)`` independent per token,
``argmax_v p_v / E_v`` is distributed exactly as ``p``. The noise ``E`` is drawn from a CPU
generator seeded by ``(seed, output_position)`` alone, so a request's token at a position does not
depend on what it was batched with, how its prompt was chunked, whether it was preempted, or
whether the position is being verified under speculative decoding (the target model's token at a
verified position is the token plain decoding would have produced there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtransfer.engine.outputs import TokenLogprobs
from kvtransfer.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Smallest noise value: a uniform draw of exactly 0 would make the race divide by zero.
_MIN_NOISE = 1e-300


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, output_position: int) -> int:
    """The 63-bit generator seed for ``(seed, output_position)``.

    Hashing (rather than e.g. ``seed + position``) keeps neighbouring requests' streams apart:
    request seeds ``s`` and ``s + 1`` must not replay each other shifted by one position.
    """
    if output_position < 0:
        raise ValueError(f"output_position must be >= 0, got {output_position}")
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_position) >> 1


def exponential_noise(
    seed: int, output_position: int, vocab_size: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``Exp(1)`` noise over the vocabulary for ``(seed, output_position)``: float64 on CPU.

    ``generator`` is only a reusable CPU generator (it is re-seeded here), not a source of extra
    randomness.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    gen = generator if generator is not None else torch.Generator(device="cpu")
    gen.manual_seed(noise_seed(seed, output_position))
    uniform = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
    # -log1p(-u) maps [0, 1) onto [0, inf) without losing precision near 0.
    return torch.neg(torch.log1p(-uniform)).clamp_min_(_MIN_NOISE)


def compute_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``params`` samples from for one row of logits (float32, same device).

    Greedy gives a one-hot on the lowest-id maximum. Otherwise: softmax of ``logits / T``,
    restricted to the ``top_k`` most likely tokens (ties broken by lowest id, so exactly ``k``
    survive), then to the smallest most-likely prefix holding at least ``top_p`` of what is left;
    at least one token always survives, and the survivors are renormalised.
    """
    if logits_row.dim() != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {tuple(logits_row.shape)}")
    row = logits_row.float()
    vocab = row.shape[0]
    if params.is_greedy:
        probs = torch.zeros_like(row)
        probs[torch.argmax(row)] = 1.0
        return probs
    scaled = row / params.temperature
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(scaled, dim=0)
    # A stable descending sort puts equal logits in id order, which is what makes top-k=1
    # agree with greedy on ties.
    sorted_logits, order = torch.sort(scaled, descending=True, stable=True)
    if top_k:
        sorted_logits[top_k:] = float("-inf")
    if params.top_p < 1.0:
        sorted_probs = torch.softmax(sorted_logits, dim=0)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        drop = mass_before >= params.top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.zeros_like(row)
    probs[order] = torch.softmax(sorted_logits, dim=0)
    return probs


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_positions: Sequence[int],
) -> torch.Tensor:
    """One token per row of ``logits`` ``[n, vocab]``: int64 ``[n]`` on the logits' device.

    Row ``i`` samples with ``params[i]`` the token at sequence position ``output_positions[i]`` of
    a request seeded ``seeds[i]``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    for name, values in (
        ("params", params),
        ("seeds", seeds),
        ("output_positions", output_positions),
    ):
        if len(values) != num_rows:
            raise ValueError(f"{name} has {len(values)} entries for {num_rows} rows of logits")
    for pos in output_positions:
        if pos < 0:
            raise ValueError(f"output_position must be >= 0, got {pos}")

    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        tokens[index] = torch.argmax(logits[index], dim=-1)
    if random_rows:
        generator = torch.Generator(device="cpu")
        noise = torch.stack(
            [
                exponential_noise(seeds[i], output_positions[i], vocab, generator)
                for i in random_rows
            ]
        ).to(logits.device)
        # Each row's probabilities are computed alone so that its floating-point result cannot
        # depend on the batch around it; the race itself is elementwise and per row.
        probs = torch.stack([compute_probs(logits[i], params[i]) for i in random_rows])
        index = torch.tensor(random_rows, device=logits.device)
        tokens[index] = torch.argmax(probs.double() / noise, dim=-1)
    return tokens


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Per row of ``logits`` ``[n, vocab]``: the log-probability of ``token_ids[i]`` and the ``k``
    most likely tokens', under the raw distribution (log-softmax in float32, before temperature
    or truncation: what the model says, whatever the request sampled with). Ties go to the
    lower id, as greedy sampling breaks them."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(
            f"logits must be [{len(token_ids)}, vocab] for {len(token_ids)} tokens, "
            f"got shape {tuple(logits.shape)}"
        )
    # Stay on the logits' device: only n sampled values and n * k top entries are copied back,
    # not the [n, vocab] matrix.
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    sampled = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if k:
        # A stable descending sort keeps equal values in id order; topk does not promise it.
        values, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        top_ids, top_values = order[:, :k].tolist(), values[:, :k].tolist()
    return [
        TokenLogprobs(int(token), float(value), tuple(zip(ids, values_row, strict=True)))
        for token, value, ids, values_row in zip(
            token_ids, sampled, top_ids, top_values, strict=True
        )
    ]
