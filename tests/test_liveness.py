"""Dead producers fail a load in about a second; slow ones are waited for.

Real processes (`PDPair`), real gRPC and UCX. The transfer timeout is a minute here, so a load
that ends well before it was ended by the liveness probes
(`kvtransfer.connectors.ucx.liveness`), not by the timeout; the bounds below
only tell those two apart.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from pd_harness import PDPair
from ucx_helpers.engines import BLOCK_SIZE, DECODE, PROMPTS, colocated
from ucx_helpers.pd import decode_while_loading

pytestmark = pytest.mark.integration

OVERRIDES = {"block_size": BLOCK_SIZE, "num_kv_blocks": 64}
TRANSFER_TIMEOUT_S = 60.0
# Far below the transfer timeout, far above what the probes need (~0.25-1.5 s).
DEAD_WITHIN_S = 15.0


@pytest.fixture(autouse=True)
def _no_child_left():
    yield
    assert mp.active_children() == []


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in colocated(PROMPTS)]


def _pair(policy: str = "fail") -> PDPair:
    return PDPair(
        engine_overrides=OVERRIDES,
        kv_load_failure_policy=policy,
        extra_config={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "kv_lease_s": 60.0},
    )


def test_a_stopped_producer_that_resumes_within_the_lease_still_serves(expected):
    with _pair() as pair:
        # Handshake and endpoints cached: the next load goes straight to the pull.
        assert pair.generate([PROMPTS[0]], DECODE)[0].token_ids == expected[0]
        (prefilled,) = pair.run_prefill([PROMPTS[3]])
        os.kill(pair.prefill.pid, signal.SIGSTOP)
        try:
            thread, outcome = decode_while_loading(pair, prefilled.kv_transfer_params)
            # Several probe rounds: a stopped process still accepts connections (the kernel
            # does), so it is slow, not dead.
            time.sleep(3.0)
        finally:
            os.kill(pair.prefill.pid, signal.SIGCONT)
        thread.join(timeout=TRANSFER_TIMEOUT_S + 30)
        assert not thread.is_alive()
        (result,) = outcome
        assert result.finish_reason == "length", result.error
        assert result.token_ids == expected[3]
        pair.check_no_leaks()
        stats = pair.decode.stats()
    assert stats["connector"].get("num_loads_failed", 0) == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_killed_during_the_pull_fails_the_load_in_about_a_second(expected, policy):
    with _pair(policy) as pair:
        assert pair.generate([PROMPTS[0]], DECODE)[0].token_ids == expected[0]
        (prefilled,) = pair.run_prefill([PROMPTS[3]])
        os.kill(pair.prefill.pid, signal.SIGSTOP)
        thread, outcome = decode_while_loading(pair, prefilled.kv_transfer_params)
        killed = time.monotonic()
        pair.prefill.kill()
        thread.join(timeout=TRANSFER_TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed
        assert not thread.is_alive()
        (result,) = outcome
        if policy == "fail":
            assert result.finish_reason == "error"
            assert result.token_ids == []
        else:
            assert result.token_ids == expected[3]
        assert elapsed < DEAD_WITHIN_S, f"the dead producer was noticed after {elapsed:.1f} s"
        pair.decode.check_no_leaks()
        stats = pair.decode.stats()
    assert stats["num_used_blocks"] == 0
    assert stats["connector"]["num_loads_failed"] == 1
