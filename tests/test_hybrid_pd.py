"""A hybrid model (``builtin:tiny-hybrid``: sliding-window layers beside full attention) served
disaggregated by real daemons: every pairing reproduces a colocated run's tokens on both data
planes, the decode receives every full-attention block but only the window's tail of the
sliding-window group, and no block stays in use on either side. Across hosts, through the
router: tests/test_hybrid_multihost.py."""

from __future__ import annotations

import pytest
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, colocated
from serve_helpers.hybrid import (
    LAYER_BLOCK_BYTES,
    LAYERS_PER_GROUP,
    MODEL,
    prompt_tokens,
    window_tail_blocks,
)
from serve_helpers.pair import DaemonPair

pytestmark = pytest.mark.integration

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS, model=MODEL)


@pytest.mark.parametrize(
    ("prefill", "decode", "data_plane"),
    [
        ((1, 1), (1, 1), "rma"),
        ((1, 1), (1, 1), "tagged"),
        ((2, 1), (1, 2), "rma"),
        pytest.param((1, 2), (2, 1), "tagged", marks=pytest.mark.slow),
    ],
    ids=["rma", "tagged", "tp2-to-pp2-rma", "pp2-to-tp2-tagged"],
)
def test_hybrid_pairings_equal_colocated(tmp_path, expected, prefill, decode, data_plane):
    def flags(tp: int, pp: int) -> list[str]:
        return ["--tp", str(tp), "--pp", str(pp)]

    started = DaemonPair.start(
        tmp_path,
        common_flags=["--model", MODEL],
        prefill_flags=flags(*prefill),
        decode_flags=flags(*decode),
        extra_config={"data_plane": data_plane},
    )
    with started as pair:
        results = pair.generate(PROMPTS, MAX_TOKENS)
        assert [r.token_ids for r in results] == expected
        assert [r.metrics.num_recomputed_tokens for r in results] == [0] * len(PROMPTS)
        pair.wait_no_blocks_in_use()
        sent, received = pair.status("prefill"), pair.status("decode")
        pair.stop()
    tokens = [prompt_tokens(p) for p in PROMPTS]
    full = sum(-(-n // BLOCK_SIZE) for n in tokens)
    tails = sum(window_tail_blocks(n) for n in tokens)
    assert tails < full  # the long prompts leave blocks behind the window
    # Blocks of every group: the full-attention group's all, the window's tail.
    assert received.counters["kv_blocks_received"] == full + tails
    expected_bytes = (full + tails) * LAYERS_PER_GROUP * LAYER_BLOCK_BYTES
    assert received.counters["kv_bytes_received"] == expected_bytes
    assert sent.counters["kv_blocks_sent"] == full + tails
    if data_plane == "tagged":
        # Counted as served; one-sided reads are counted from the consumer's block count
        # times every layer's bytes (docs/limits.md), which overcounts a hybrid model's.
        assert sent.counters["kv_bytes_sent"] == expected_bytes
