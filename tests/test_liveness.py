"""Dead producers fail a load in about a second; slow ones are waited for.

Real daemons (`serve_helpers.pair.DaemonPair`), real gRPC and UCX. The transfer timeout is a
minute here, so a load that ends well before it was ended by the liveness probes
(`kvtransfer.connectors.ucx.liveness`), not by the timeout; the bounds below only tell those
two apart.
"""

from __future__ import annotations

import time

import pytest
from serve_helpers.daemons import PROMPTS, admin, colocated
from serve_helpers.pair import DaemonPair, Stopped

from kvtransfer.clients.generation import GenerateResult

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
TRANSFER_TIMEOUT_S = 60.0
# Far below the transfer timeout, far above what the probes need (~0.25-1.5 s).
DEAD_WITHIN_S = 15.0
# Several probe rounds (one every 0.25 s).
STOPPED_FOR_S = 3.0
# The decode worker posts its pull on the step that starts the load, well within this.
PULL_POSTED_AFTER_S = 0.3
PROMPT = PROMPTS[2]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS)


def _pair(log_dir, policy: str = "fail") -> DaemonPair:
    return DaemonPair.start(
        log_dir,
        kv_load_failure_policy=policy,
        extra_config={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "kv_lease_s": 60.0},
    )


def _warm_and_prefill(pair: DaemonPair, expected: list[list[int]]) -> GenerateResult:
    # Handshake and UCX endpoints cached by a first request: the next load goes straight to
    # the pull.
    assert pair.generate([PROMPTS[0]], MAX_TOKENS)[0].token_ids == expected[0]
    (prefilled,) = pair.run_prefill([PROMPT])
    assert prefilled.kv_transfer_params is not None
    return prefilled


def test_a_stopped_producer_that_resumes_within_the_lease_still_serves(tmp_path, expected):
    with _pair(tmp_path) as pair:
        prefilled = _warm_and_prefill(pair, expected)
        rid = prefilled.request_id
        pair.pause("prefill")
        try:
            decode = pair.decode_in_background(
                PROMPT, prefilled.kv_transfer_params, rid, MAX_TOKENS
            )
            # A stopped process still accepts connections (the kernel does), so it is slow,
            # not dead: after several probe rounds the load is still waiting.
            pair.wait_loading(rid, for_at_least_s=STOPPED_FOR_S)
        finally:
            pair.resume("prefill")
        result = decode.result(TRANSFER_TIMEOUT_S + 30)
        assert isinstance(result, GenerateResult), result
        assert result.finish_reason == "length", result.error
        assert result.token_ids == expected[2]
        assert result.metrics.num_recomputed_tokens == 0
        pair.wait_no_blocks_in_use()
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert failures == {}
    assert stopped == {"decode": Stopped(0, 0), "prefill": Stopped(0, 0)}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_killed_during_the_pull_fails_the_load_in_about_a_second(
    tmp_path, expected, policy
):
    with _pair(tmp_path, policy) as pair:
        prefilled = _warm_and_prefill(pair, expected)
        rid = prefilled.request_id
        # Frozen, the prefill still holds the pull's endpoint open but answers nothing: the
        # decode worker's pull is posted and waiting when the process dies.
        pair.pause("prefill")
        decode = pair.decode_in_background(PROMPT, prefilled.kv_transfer_params, rid, MAX_TOKENS)
        pair.wait_loading(rid, for_at_least_s=PULL_POSTED_AFTER_S)
        killed = time.monotonic()
        pair.kill("prefill")
        result = decode.result(TRANSFER_TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed
        assert isinstance(result, GenerateResult), result
        if policy == "fail":
            assert result.finish_reason == "error"
            assert result.error.startswith(f"KV load failed for request {rid} ")
            assert "ProducerUnreachable" in result.error  # the probes, not the timeout
            assert result.token_ids == []
        else:
            assert result.finish_reason == "length", result.error
            assert result.token_ids == expected[2]
            assert result.metrics.num_recomputed_tokens > 0
        assert elapsed < DEAD_WITHIN_S, f"the dead producer was noticed after {elapsed:.1f} s"
        pair.wait_no_blocks_in_use()
        loading = admin(pair.decode.address, "transfers")
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert loading == []
    assert failures == {{"fail": "kv_load_failed", "recompute": "kv_load_recomputed"}[policy]: 1.0}
    assert stopped["decode"] == Stopped(0, 0)
