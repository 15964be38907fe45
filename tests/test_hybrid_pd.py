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
    MAMBA_MODEL,
    MAMBA_STATE_BYTES,
    MODEL,
    prompt_tokens,
    window_tail_blocks,
)
from serve_helpers.pair import DaemonPair

pytestmark = pytest.mark.integration

MAX_TOKENS = 6


def flags(tp: int, pp: int) -> list[str]:
    return ["--tp", str(tp), "--pp", str(pp)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS, model=MODEL)


@pytest.mark.parametrize(
    ("prefill", "decode", "data_plane"),
    # 1x1 on both planes: through the router, tests/test_hybrid_multihost.py.
    [((2, 1), (1, 2), "rma"), ((1, 2), (2, 1), "tagged")],
    ids=["tp2-to-pp2-rma", "pp2-to-tp2-tagged"],
)
def test_hybrid_pairings_equal_colocated(tmp_path, expected, prefill, decode, data_plane):
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


@pytest.fixture(scope="module")
def expected_mamba() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS, model=MAMBA_MODEL)


@pytest.mark.parametrize(
    ("prefill", "decode", "data_plane"),
    # 1x1: through the router, tests/test_hybrid_multihost.py.
    [((2, 1), (1, 1), "rma"), ((1, 1), (2, 1), "tagged"), ((1, 2), (1, 1), "rma")],
    ids=["tp2-to-1-rma", "1-to-tp2-tagged", "pp2-to-1-rma"],
)
def test_mamba_hybrid_pairings_equal_colocated(
    tmp_path, expected_mamba, prefill, decode, data_plane
):
    """``builtin:tiny-mamba``: the decode continues from the prefill's recurrent state (one
    block per layer, the state after the prompt) beside every full-attention block; between TP
    sizes each decode rank reads the state heads it holds from the prefill ranks holding them."""

    started = DaemonPair.start(
        tmp_path,
        common_flags=["--model", MAMBA_MODEL],
        prefill_flags=flags(*prefill),
        decode_flags=flags(*decode),
        extra_config={"data_plane": data_plane},
    )
    with started as pair:
        results = pair.generate(PROMPTS, MAX_TOKENS, hand_first_token=True)
        # The decode continues after the prefill's first token, which it was handed.
        assert [r.token_ids for r in results] == [tokens[1:] for tokens in expected_mamba]
        assert [r.metrics.num_recomputed_tokens for r in results] == [0] * len(PROMPTS)
        pair.wait_no_blocks_in_use()
        sent, received = pair.status("prefill"), pair.status("decode")
        pair.stop()
    full = sum(-(-prompt_tokens(p) // BLOCK_SIZE) for p in PROMPTS)
    # Per request: its full-attention blocks and one state block.
    assert received.counters["kv_blocks_received"] == full + len(PROMPTS)
    expected_bytes = LAYERS_PER_GROUP * (
        full * LAYER_BLOCK_BYTES + len(PROMPTS) * MAMBA_STATE_BYTES
    )
    assert received.counters["kv_bytes_received"] == expected_bytes
    if data_plane == "tagged":
        assert sent.counters["kv_bytes_sent"] == expected_bytes


def test_a_decode_that_would_recompute_the_last_token_from_a_state_fails_typed(tmp_path):
    """Without the prefill's first token the decode would compute the prompt's last token
    again, from a state that already holds it: refused, typed, blocks freed, serving on."""
    started = DaemonPair.start(tmp_path, common_flags=["--model", MAMBA_MODEL])
    with started as pair:
        (result,) = pair.generate(PROMPTS[1:2], MAX_TOKENS)
        assert result.finish_reason == "error"
        assert result.error == (
            f"KV load failed for request {result.request_id} (kv_load_failure_policy=fail): a "
            "recurrent state cannot be rewound: a loaded state continues only after the "
            "prompt's last token (a decode given the prefill's first token)"
        )
        (served,) = pair.generate(PROMPTS[1:2], MAX_TOKENS, hand_first_token=True)
        assert served.finish_reason == "length"
        pair.wait_no_blocks_in_use()
        pair.stop()


def test_a_decode_prefix_hit_moves_only_what_each_group_misses(tmp_path):
    """A second turn (the first prompt, its answer, a new question): the decode has every full
    block of the first turn cached in both groups (the window's tail it loaded or computed), so
    only the blocks after that move, in both groups, and the tokens equal colocated."""
    first = list(PROMPTS[2].encode())[:173]
    with DaemonPair.start(tmp_path, common_flags=["--model", MODEL]) as pair:
        (turn,) = pair.generate([first], MAX_TOKENS)
        second = [*first, *turn.token_ids, *b" And then?"]
        (answer,) = pair.generate([second], MAX_TOKENS)
        pair.wait_no_blocks_in_use()
        pair.stop()
    assert [turn.token_ids, answer.token_ids] == colocated([first, second], MAX_TOKENS, model=MODEL)
    assert turn.metrics.kv_blocks_received == 11 + window_tail_blocks(173)
    # The first turn left 176 tokens (11 blocks) of KV computed on the decode: the window's
    # tail at 176 (blocks 9 and 10) is among them. Block 11 moves, in both groups.
    assert answer.metrics.kv_blocks_received == 2
