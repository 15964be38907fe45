"""Prefill and decode engines in other processes, the one way tests run them: real daemons
(`serve_helpers.pair.DaemonPair`), real gRPC and UCX over loopback. Every TPxPP pairing
reproduces a colocated run's greedy tokens and leaves no block in use on either side nor any
worker process behind; a prefill killed before the pull fails or recomputes the decode request
per its policy, and calls to it fail at once instead of hanging; the lease frees blocks nobody
pulls; a daemon that cannot start is a typed error that leaves nothing running.

Elsewhere against the same daemons: 1-to-1 equality and the per-request KV metrics
(tests/test_daemons.py), bad requests rejected with the field named while the daemon goes on
(tests/test_daemons.py), a cancelled call aborted with its blocks freed (tests/test_daemons.py,
tests/test_abandoned_calls.py), KV held for a consumer listed by KVAdmin (tests/test_daemons.py),
and a producer killed or stopped during the pull (tests/test_liveness.py).
"""

from __future__ import annotations

import os

import grpc
import pytest
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, admin, colocated
from serve_helpers.pair import DaemonPair, Stopped, descendants, is_gone
from waiting import wait_until

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.serve.launcher import ServiceStartError

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
CLEAN_EXIT = {"decode": Stopped(0, 0), "prefill": Stopped(0, 0)}


def blocks_of(prompt: str) -> int:
    # The built-in tokenizer: one token per byte.
    return -(-len(prompt.encode()) // BLOCK_SIZE)


@pytest.fixture(autouse=True)
def _no_process_left():
    before = set(descendants(os.getpid()))
    yield
    wait_until(
        lambda: set(descendants(os.getpid())) <= before,
        "every process a test started has exited",
        30,
    )


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS)


def _check_pairing(log_dir, expected, prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    def flags(tp: int, pp: int) -> list[str]:
        return ["--tp", str(tp), "--pp", str(pp)]

    started = DaemonPair.start(log_dir, prefill_flags=flags(*prefill), decode_flags=flags(*decode))
    with started as pair:
        workers = pair.worker_pids()
        results = pair.generate(PROMPTS, MAX_TOKENS)
        assert [r.token_ids for r in results] == expected
        assert [r.request_id for r in results] == ["pd-0", "pd-1", "pd-2"]
        assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
        assert [r.metrics.kv_blocks_received for r in results] == [blocks_of(p) for p in PROMPTS]
        assert [r.metrics.num_recomputed_tokens for r in results] == [0] * len(PROMPTS)
        pair.wait_no_blocks_in_use()
        sent, received = pair.status("prefill"), pair.status("decode")
        stopped = pair.stop()
    assert (sent.tp_size, sent.pp_size, received.tp_size, received.pp_size) == (*prefill, *decode)
    num_blocks = sum(blocks_of(p) for p in PROMPTS)
    assert sent.counters["kv_blocks_sent"] == received.counters["kv_blocks_received"] == num_blocks
    assert sent.counters["kv_leases_expired"] == 0
    assert received.counters["kv_tokens_recomputed"] == 0
    assert stopped == CLEAN_EXIT
    # A daemon's TPxPP > 1 engine runs one process per worker; none outlives its daemon.
    world = [tp * pp for tp, pp in (prefill, decode)]
    assert len(workers) == sum(size for size in world if size > 1)
    wait_until(lambda: all(is_gone(pid) for pid in workers), "worker processes exited", 15)


def test_tp2_prefill_to_pp2_decode_equals_colocated(tmp_path, expected):
    _check_pairing(tmp_path, expected, prefill=(2, 1), decode=(1, 2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((1, 2), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (1, 2))],
    ids=["pp2-to-1", "1-to-tp2", "tp2pp2-to-pp2"],
)
def test_more_pairings_equal_colocated(tmp_path, expected, prefill, decode):
    _check_pairing(tmp_path, expected, prefill, decode)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_before_the_pull(tmp_path, expected, policy):
    prompt = PROMPTS[2]
    extra = {"handshake_timeout_s": 0.5}
    with DaemonPair.start(tmp_path, kv_load_failure_policy=policy, extra_config=extra) as pair:
        (prefilled,) = pair.run_prefill([prompt])
        params = prefilled.kv_transfer_params
        assert params is not None and params["remote_request_id"] == "pd-0"
        pair.kill("prefill")
        # A dead daemon never hangs its caller: the next call to it fails at once.
        with (
            GenerationClient(pair.prefill.address) as client,
            pytest.raises(grpc.RpcError) as dead,
        ):
            client.generate(generate_request("pd-1", prompt, 1), timeout_s=10)
        assert dead.value.code() == grpc.StatusCode.UNAVAILABLE
        (result,) = pair.run_decode([prompt], [params], ["pd-0"], MAX_TOKENS)
        if policy == "fail":
            assert result.finish_reason == "error"
            assert result.error.startswith(
                "KV load failed for request pd-0 (kv_load_failure_policy=fail)"
            )
            assert result.token_ids == []
        else:
            # The decode computed the prompt itself.
            assert result.finish_reason == "length", result.error
            assert result.token_ids == expected[2]
            assert result.metrics.num_recomputed_tokens > 0
        pair.wait_no_blocks_in_use()
        counters = pair.counters("decode")
        failures = pair.failures("decode")
        stopped = pair.stop()
    reason = {"fail": "kv_load_failed", "recompute": "kv_load_recomputed"}[policy]
    assert failures == {reason: 1.0}
    assert counters["requests_failed"] == (policy == "fail")
    assert (counters["kv_tokens_recomputed"] > 0) == (policy == "recompute")
    assert stopped["decode"] == Stopped(0, 0)
    assert stopped["prefill"] == Stopped(-9, None)


def test_the_lease_frees_blocks_decode_never_pulls(tmp_path):
    # Long enough to see the blocks held after both prefills on a busy host, short to wait out.
    lease_s = 2.0
    with DaemonPair.start(tmp_path, extra_config={"kv_lease_s": lease_s}) as pair:
        prefilled = pair.run_prefill(PROMPTS[1:])
        assert all(r.kv_transfer_params["do_remote_prefill"] for r in prefilled)
        held = {t.request_id: t.num_blocks for t in admin(pair.prefill.address, "transfers")}
        assert held == {"pd-0": blocks_of(PROMPTS[1]), "pd-1": blocks_of(PROMPTS[2])}
        pair.wait_no_blocks_in_use(timeout_s=lease_s + 30)
        counters = pair.counters("prefill")
        stopped = pair.stop()
    assert counters["kv_leases_expired"] == 2
    assert counters["kv_blocks_sent"] == 0
    assert stopped == CLEAN_EXIT


def test_a_daemon_that_cannot_start_is_a_typed_error_and_leaves_nothing_running(tmp_path):
    with pytest.raises(ServiceStartError) as failed:
        DaemonPair.start(tmp_path, decode_flags=["--model", "builtin:no-such-preset"])
    message = str(failed.value)
    assert message.startswith("pd-decode exited with code 1 before it was ready")
    # The log tail says why.
    assert "start-up failed: ValueError: unknown built-in model preset 'no-such-preset'" in message
    # The prefill that did start was stopped (the autouse fixture sees no process left).
