"""The P/D harness with real processes, real gRPC and real UCX over loopback: a prefill engine
and a decode engine in their own processes reproduce a colocated run's greedy tokens; a killed
prefill fails or recomputes the decode request without hanging; unpulled blocks are freed by
the lease; no child process outlives its test."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from pd_harness import (
    EngineLeakError,
    EngineProcess,
    EngineProcessClosed,
    EngineProcessDied,
    EngineProcessTimeout,
    KVTransferFailed,
    PDPair,
    RemoteEngineError,
)
from ucx_helpers.engines import BLOCK_SIZE, DECODE, PROMPTS, colocated
from ucx_helpers.pd import decode_while_loading

from kvtransfer.engine.config import EngineConfig
from kvtransfer.engine.sampling_params import SamplingParams

OVERRIDES = {"block_size": BLOCK_SIZE, "num_kv_blocks": 64}


def blocks_of(prompt: list[int]) -> int:
    return -(-len(prompt) // BLOCK_SIZE)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether ``pid`` exited (a zombie counts: it runs nothing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def _no_child_left():
    yield
    assert mp.active_children() == []


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [o.token_ids for o in colocated(PROMPTS)]


def _check_pair(expected, **splits) -> None:
    with PDPair(engine_overrides=OVERRIDES, **splits) as pair:
        results = pair.generate(PROMPTS, DECODE)
        assert [r.token_ids for r in results] == expected
        assert [r.request_id for r in results] == ["pd-0", "pd-1", "pd-2", "pd-3"]
        assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
        pair.check_no_leaks()
        prefill, decode = pair.prefill.stats(), pair.decode.stats()
        worker_pids = pair.prefill.ready_info.worker_pids + pair.decode.ready_info.worker_pids
    decode_workers = splits.get("decode_tp", 1) * splits.get("decode_pp", 1)
    prefill_workers = splits.get("prefill_tp", 1) * splits.get("prefill_pp", 1)
    num_blocks = sum(blocks_of(p) for p in PROMPTS)
    assert prefill["num_used_blocks"] == decode["num_used_blocks"] == 0
    assert prefill["connector"]["num_sends"] == len(PROMPTS) * prefill_workers
    assert "num_leases_expired" not in prefill["connector"]
    assert decode["connector"]["num_loads"] == len(PROMPTS) * decode_workers
    assert decode["connector"]["blocks_received"] == num_blocks * decode_workers
    assert (
        len(worker_pids)
        == (prefill_workers > 1) * prefill_workers + (decode_workers > 1) * decode_workers
    )
    assert all(_gone(pid) for pid in worker_pids)


def test_one_to_one_equals_colocated(expected):
    _check_pair(expected)


def test_tp2_prefill_to_pp2_decode_equals_colocated(expected):
    _check_pair(expected, prefill_tp=2, decode_pp=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "splits",
    [
        {"prefill_pp": 2},
        {"decode_tp": 2},
        {"prefill_tp": 2, "prefill_pp": 2, "decode_pp": 2},
    ],
    ids=["pp2-to-1", "1-to-tp2", "tp2pp2-to-pp2"],
)
def test_more_pairings_equal_colocated(expected, splits):
    _check_pair(expected, **splits)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_before_the_pull(expected, policy):
    extra = {"handshake_timeout_s": 0.5}
    with PDPair(
        engine_overrides=OVERRIDES, kv_load_failure_policy=policy, extra_config=extra
    ) as pair:
        (prefilled,) = pair.run_prefill([PROMPTS[3]])
        params = prefilled.kv_transfer_params
        assert params["remote_request_id"] == "pd-0"
        pair.prefill.kill()
        with pytest.raises(EngineProcessDied, match=r"'pd-prefill' died with exit code -9 \("):
            pair.prefill.stats()
        if policy == "fail":
            message = (
                r"1 of 1 decode request\(s\) failed: pd-0: KV load failed for request pd-0 "
                r"\(kv_load_failure_policy=fail\)"
            )
            with pytest.raises(KVTransferFailed, match=message) as failed:
                pair.run_decode([PROMPTS[3]], DECODE, [params], ["pd-0"], raise_on_error=True)
            assert failed.value.outputs[0].token_ids == []
        else:
            (result,) = pair.run_decode([PROMPTS[3]], DECODE, [params], ["pd-0"])
            assert result.token_ids == expected[3]
        pair.decode.check_no_leaks()
        stats = pair.decode.stats()
    assert stats["num_used_blocks"] == 0
    assert stats["connector"]["num_loads_failed"] == 1


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_mid_transfer(expected, policy):
    extra = {"transfer_timeout_s": 2.0, "handshake_timeout_s": 0.5}
    with PDPair(
        engine_overrides=OVERRIDES, kv_load_failure_policy=policy, extra_config=extra
    ) as pair:
        # Handshake and UCX endpoint are cached by this first request, so the next pull goes
        # straight to the prefill worker.
        assert pair.generate([PROMPTS[0]], DECODE)[0].token_ids == expected[0]
        (prefilled,) = pair.run_prefill([PROMPTS[3]])
        # Frozen, the prefill still holds the pull's endpoint open but answers nothing: the
        # decode worker's pull is posted and waiting when the process dies.
        os.kill(pair.prefill.pid, signal.SIGSTOP)
        thread, outcome = decode_while_loading(pair, prefilled.kv_transfer_params)
        pair.prefill.kill()
        thread.join(timeout=60)
        assert not thread.is_alive()
        (result,) = outcome
        if policy == "fail":
            assert result.finish_reason == "error"
            assert result.error.startswith("KV load failed for request ")
            assert result.token_ids == []
        else:
            assert result.token_ids == expected[3]
        pair.decode.check_no_leaks()
        stats = pair.decode.stats()
    assert stats["num_used_blocks"] == 0
    assert stats["num_loading_remote_kvs"] == 0
    assert stats["connector"]["num_loads_failed"] == 1


def test_prefill_killed_makes_generate_raise_died():
    with PDPair(engine_overrides=OVERRIDES) as pair:
        pair.prefill.kill()
        with pytest.raises(EngineProcessDied, match="engine process 'pd-prefill' died"):
            pair.generate([PROMPTS[0]], DECODE)
        pair.decode.check_no_leaks()


def test_lease_frees_blocks_decode_never_pulls():
    with PDPair(engine_overrides=OVERRIDES, extra_config={"kv_lease_s": 0.3}) as pair:
        prefilled = pair.run_prefill(PROMPTS[:2])
        assert all(o.kv_transfer_params["do_remote_prefill"] for o in prefilled)
        held = pair.prefill.stats()["num_used_blocks"]
        pair.check_no_leaks()
        stats = pair.prefill.stats()
    assert held == blocks_of(PROMPTS[0]) + blocks_of(PROMPTS[1])
    assert stats["num_used_blocks"] == 0
    assert stats["connector"]["num_leases_expired"] == 2
    assert "num_sends" not in stats["connector"]


def test_check_no_leaks_reports_blocks_still_lent():
    with PDPair(engine_overrides=OVERRIDES) as pair:
        pair.run_prefill([PROMPTS[1]])
        message = r"'pd-prefill' failed: TimeoutError: engine still has pending work after 0.2 s"
        with pytest.raises(EngineLeakError, match=message):
            pair.prefill.check_no_leaks(drain_timeout_s=0.2)


def _plain_config(**overrides) -> EngineConfig:
    return EngineConfig(**{**OVERRIDES, **overrides})


def test_engine_process_life_cycle(expected):
    engine = EngineProcess(_plain_config(), name="solo")
    with engine:
        (output,) = engine.generate(PROMPTS[2], DECODE)
        assert (output.request_id, output.token_ids) == ("solo-0", expected[2])
        named = engine.generate([PROMPTS[0]], DECODE, request_ids=["mine"])
        assert named[0].request_id == "mine"
        with pytest.raises(ValueError, match="got 2 prompts, 1 sampling params"):
            engine.generate(PROMPTS[:2], [DECODE])
        with pytest.raises(ValueError, match=r"request ids must be unique, got \['a', 'a'\]"):
            engine.generate(PROMPTS[:2], DECODE, request_ids=["a", "a"])
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        with pytest.raises(EngineProcessTimeout, match="'solo' did not answer Generate within"):
            engine.generate([PROMPTS[3]], long, timeout_s=0.001)
        # The timed-out request was aborted; the engine goes on serving.
        engine.check_no_leaks()
        assert engine.stats()["num_unfinished_requests"] == 0
        assert engine.generate([PROMPTS[2]], DECODE)[0].token_ids == expected[2]
    engine.shutdown()
    assert not engine.is_alive()
    with pytest.raises(EngineProcessClosed, match="engine process 'solo' was shut down"):
        engine.stats()


def test_engine_process_rejects_a_bad_request_and_goes_on(expected):
    with EngineProcess(_plain_config(), name="strict") as engine:
        with pytest.raises(RemoteEngineError, match="'strict' failed: ValueError: "):
            engine.generate([[]], DECODE)
        assert engine.generate([PROMPTS[1]], DECODE)[0].token_ids == expected[1]


def test_startup_failure_is_typed():
    with pytest.raises(RemoteEngineError, match="'broken' failed: "):
        EngineProcess(_plain_config(model="builtin:no-such-preset"), name="broken")


def test_killed_engine_process_never_hangs_the_parent():
    engine = EngineProcess(_plain_config(), name="victim")
    pid = engine.pid
    engine.kill()
    for call in (engine.stats, lambda: engine.generate([PROMPTS[0]]), engine.check_no_leaks):
        with pytest.raises(EngineProcessDied, match=r"'victim' died with exit code -9 \(SIGKILL\)"):
            call()
    engine.shutdown()
    engine.shutdown()
    assert pid is not None and _gone(pid)
