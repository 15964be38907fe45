"""GPU tier of the P/D harness: prefill and decode engines on CUDA (TP1 each side) in their own
processes, KV pulled GPU to GPU over UCX, reproduce a colocated CUDA run's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from pd_harness import PDPair
from ucx_helpers.engines import BLOCK_SIZE, DECODE, PROMPTS, colocated

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

OVERRIDES = {"block_size": BLOCK_SIZE, "num_kv_blocks": 64, "device": "cuda"}


def test_cuda_disaggregated_equals_colocated():
    expected = [o.token_ids for o in colocated(PROMPTS, device="cuda")]
    with PDPair(engine_overrides=OVERRIDES, name="gpu") as pair:
        results = pair.generate(PROMPTS, DECODE)
        pair.check_no_leaks()
        decode = pair.decode.stats()
    assert [r.token_ids for r in results] == expected
    assert decode["connector"]["num_loads"] == len(PROMPTS)
    assert decode["num_used_blocks"] == 0
