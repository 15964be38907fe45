"""Dead producers fail a load in about a second; slow ones are waited for.

Real daemons (`serve_helpers.pair.DaemonPair`), real gRPC and UCX. The transfer timeout is a
minute here, so a load that ends well before it was ended by the liveness probes
(`kvtransfer.connectors.ucx.liveness`), not by the timeout; the bounds below only tell those
two apart.

The tagged data plane needs the producer to answer each pull, so a frozen producer leaves the
pull posted and waiting: that is where the probes decide. One-sided (RMA) reads on one host do
not need the producer's process to run at all: a frozen producer's KV is still read, and a
dead one fails the read at once (the kernel says the process is gone).
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


def _pair(log_dir, policy: str = "fail", data_plane: str = "tagged") -> DaemonPair:
    return DaemonPair.start(
        log_dir,
        kv_load_failure_policy=policy,
        extra_config={
            "transfer_timeout_s": TRANSFER_TIMEOUT_S,
            "kv_lease_s": 60.0,
            "data_plane": data_plane,
        },
    )


def _warm_and_prefill(pair: DaemonPair, expected: list[list[int]]) -> GenerateResult:
    # Handshake and UCX endpoints cached by a first request: the next load goes straight to
    # the pull.
    assert pair.generate([PROMPTS[0]], MAX_TOKENS)[0].token_ids == expected[0]
    (prefilled,) = pair.run_prefill([PROMPT])
    assert prefilled.kv_transfer_params is not None
    # Its lease is published at the prefill's next step, which may come after the answer: a
    # producer stopped before that holds KV nobody may read (under two test workers the stop
    # once came first, and the one-sided read waited out its minute for a lease never there).
    pair.step_once("prefill")
    return prefilled


def _assert_failed_per_policy(
    result: object, policy: str, rid: str, expected: list[list[int]], *reasons: str
) -> None:
    """A load that failed: ``fail`` ends the request with the reasons, ``recompute`` gives the
    colocated tokens with tokens recomputed."""
    assert isinstance(result, GenerateResult), result
    if policy == "fail":
        assert result.finish_reason == "error"
        assert result.error.startswith(f"KV load failed for request {rid} ")
        for reason in reasons:
            assert reason in result.error, result.error
        assert result.token_ids == []
    else:
        assert result.finish_reason == "length", result.error
        assert result.token_ids == expected[2]
        assert result.metrics.num_recomputed_tokens > 0


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
        # The probes, not the timeout.
        _assert_failed_per_policy(result, policy, rid, expected, "ProducerUnreachable")
        assert elapsed < DEAD_WITHIN_S, f"the dead producer was noticed after {elapsed:.1f} s"
        pair.wait_no_blocks_in_use()
        loading = admin(pair.decode.address, "transfers")
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert loading == []
    assert failures == {{"fail": "kv_load_failed", "recompute": "kv_load_recomputed"}[policy]: 1.0}
    assert stopped["decode"] == Stopped(0, 0)


def test_a_stopped_producers_kv_is_read_one_sided(tmp_path, expected):
    """RMA mode: the producer's process is frozen (SIGSTOP) and its KV is read all the same:
    no code of the producer runs per read."""
    with _pair(tmp_path, data_plane="rma") as pair:
        prefilled = _warm_and_prefill(pair, expected)
        rid = prefilled.request_id
        pair.pause("prefill")
        try:
            # Finished while the producer was still frozen.
            (result,) = pair.run_decode([PROMPT], [prefilled.kv_transfer_params], [rid], MAX_TOKENS)
            assert isinstance(result, GenerateResult), result
            assert result.finish_reason == "length", result.error
            assert result.token_ids == expected[2]
            assert result.metrics.num_recomputed_tokens == 0
        finally:
            pair.resume("prefill")
        pair.wait_no_blocks_in_use()
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert failures == {}
    assert stopped == {"decode": Stopped(0, 0), "prefill": Stopped(0, 0)}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_killed_producer_fails_the_one_sided_load_at_once(tmp_path, expected, policy):
    with _pair(tmp_path, policy, data_plane="rma") as pair:
        prefilled = _warm_and_prefill(pair, expected)
        rid = prefilled.request_id
        pair.kill("prefill")
        killed = time.monotonic()
        (result,) = pair.run_decode([PROMPT], [prefilled.kv_transfer_params], [rid], MAX_TOKENS)
        elapsed = time.monotonic() - killed
        _assert_failed_per_policy(
            result, policy, rid, expected, "PeerUnreachable", "the process is gone"
        )
        assert elapsed < DEAD_WITHIN_S, f"the dead producer was noticed after {elapsed:.1f} s"
        pair.wait_no_blocks_in_use()
        failures = pair.failures("decode")
        stopped = pair.stop()
    assert failures == {{"fail": "kv_load_failed", "recompute": "kv_load_recomputed"}[policy]: 1.0}
    assert stopped["decode"] == Stopped(0, 0)
