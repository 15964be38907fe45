"""GPU tier of the P/D daemons: a prefill and a decode daemon on CUDA (``--device cuda``, TP1
each side), KV pulled GPU to GPU over UCX, reproduce a colocated CUDA run's greedy tokens and
stop with no block in use."""

from __future__ import annotations

import pytest
import torch
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, colocated
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
