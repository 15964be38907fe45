"""GPU tier of the P/D daemons: a prefill and a decode daemon on CUDA (``--device cuda``, TP1
each side), KV pulled GPU to GPU over UCX, reproduce a colocated CUDA run's greedy tokens and
stop with no block in use; so do the hybrid presets (sliding window, Mamba2 state)."""

from __future__ import annotations

import pytest
import torch
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, colocated
from serve_helpers.hybrid import MAMBA_MODEL, MODEL, prompt_tokens, window_tail_blocks
from serve_helpers.pair import DaemonPair, Stopped

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_TOKENS = 6


def test_cuda_disaggregated_equals_colocated(tmp_path):
    expected = colocated(PROMPTS, MAX_TOKENS, device="cuda")
    with DaemonPair.start(tmp_path, name="gpu", common_flags=["--device", "cuda"]) as pair:
        results = pair.generate(PROMPTS, MAX_TOKENS)
        pair.wait_no_blocks_in_use()
        decode = pair.status("decode")
        stopped = pair.stop()
    assert [r.token_ids for r in results] == expected
    assert [r.metrics.num_recomputed_tokens for r in results] == [0] * len(PROMPTS)
    blocks = sum(-(-len(p.encode()) // BLOCK_SIZE) for p in PROMPTS)
    assert decode.counters["kv_blocks_received"] == blocks
    assert stopped == {"decode": Stopped(0, 0), "prefill": Stopped(0, 0)}


@pytest.mark.parametrize("model", [MODEL, MAMBA_MODEL])
def test_cuda_hybrid_disaggregated_equals_colocated(tmp_path, model):
    """The hybrid presets on CUDA: a sliding-window group's tail, or a Mamba2 state page per
    layer (the decode continuing after the prefill's first token), beside every full block."""
    expected = colocated(PROMPTS, MAX_TOKENS, device="cuda", model=model)
    flags = ["--device", "cuda", "--model", model]
    with DaemonPair.start(tmp_path, name="gpu-hybrid", common_flags=flags) as pair:
        if model == MAMBA_MODEL:
            results = pair.generate(PROMPTS, MAX_TOKENS, hand_first_token=True)
            expected = [tokens[1:] for tokens in expected]
        else:
            results = pair.generate(PROMPTS, MAX_TOKENS)
        pair.wait_no_blocks_in_use()
        decode = pair.status("decode")
        pair.stop()
    assert [r.token_ids for r in results] == expected
    tokens = [prompt_tokens(p) for p in PROMPTS]
    moved = sum(
        -(-n // BLOCK_SIZE) + (1 if model == MAMBA_MODEL else window_tail_blocks(n)) for n in tokens
    )
    assert decode.counters["kv_blocks_received"] == moved
