"""The hook watchdog: a connector call made to block is logged with its stack, counted, and
visible on the watchdog's own metrics endpoint while it is still blocked; bad settings are
typed errors naming the key. Our threads' kernel names and CPU sets (`kvtransfer.threads`)."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import urllib.request

import pytest
from waiting import wait_until

from kvtransfer.connector.watchdog import (
    LOAD_HOOK,
    HookWatchdog,
    WatchdogSettings,
    serve_metrics,
)
from kvtransfer.threads import enter_own_thread, kernel_name, parse_cpus, set_thread_cpus

pytestmark = pytest.mark.unit


def _blocking_hook_body(release: threading.Event) -> None:
    release.wait(10)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_a_blocked_hook_is_logged_with_its_stack_counted_and_served_while_blocked(caplog):
    watchdog = HookWatchdog(hook_bound_s=0.2, poll_s=0.05, name="worker 0")
    port = serve_metrics(watchdog, "127.0.0.1", 0)
    release = threading.Event()

    def step() -> None:
        with watchdog.watch("start_load_kv"):
            _blocking_hook_body(release)

    caplog.set_level(logging.WARNING, logger="kvtransfer.connector.watchdog")
    stepper = threading.Thread(target=step, name="vllm-step")
    stepper.start()
    try:
        wait_until(lambda: watchdog.stalls.get("start_load_kv") == 1, "a stall counted", 10)
        # Counted just before it is logged.
        wait_until(lambda: [r for r in caplog.records if r.levelno == logging.ERROR], "the log", 10)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        message = errors[0].getMessage()
        assert message.startswith("[worker 0] start_load_kv has run for ")
        assert "past its 0.2 s bound, on thread 'vllm-step' (" in message
        # Blocked in a wait: little CPU used, and the thread sleeps.
        assert "s of CPU in " in message and "sleeping: blocked on something" in message
        # The stack is the blocked thread's, down to the call it is blocked in.
        assert "_blocking_hook_body" in message and "release.wait(10)" in message
        wait_until(lambda: "start_load_kv" in watchdog.blocked_s(), "blocked_s to show it", 10)
        served = _metrics(port)
        assert 'kvtransfer_connector_hook_stalls_total{hook="start_load_kv"} 1.0' in served
        assert 'kvtransfer_connector_hook_blocked_seconds{hook="start_load_kv"}' in served
    finally:
        release.set()
        stepper.join(10)
    # Reported once per stall: the step's stats take it, and a second take is empty.
    assert watchdog.take_stalls() == {"start_load_kv": 1}
    assert watchdog.take_stalls() == {}
    assert watchdog.blocked_s() == {}
    assert "kvtransfer_connector_hook_blocked_seconds{" not in _metrics(port)
    assert any("start_load_kv returned after" in r.getMessage() for r in caplog.records)
    watchdog.close()


def test_a_slow_hook_that_computes_is_told_from_a_blocked_one(caplog):
    watchdog = HookWatchdog(hook_bound_s=0.2, poll_s=0.05)
    caplog.set_level(logging.ERROR, logger="kvtransfer.connector.watchdog")
    with watchdog.watch("save_kv_layer"):
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            sum(range(1000))
    message = caplog.records[0].getMessage()
    assert "save_kv_layer has run for" in message
    # Never called blocked: it computed, or waited for a CPU on a busy machine; which one
    # follows the CPU its thread got over the call.
    used, elapsed, how = re.search(r"\((\S+) s of CPU in (\S+) s, ([^)]*)\)", message).groups()
    share = float(used) / float(elapsed)
    if abs(share - 0.5) > 0.01:  # printed to the millisecond: the label follows the numbers
        assert how.startswith("computing" if share > 0.5 else "runnable: waiting"), message
    watchdog.close()


def test_calls_within_their_bound_are_not_reported(caplog):
    watchdog = HookWatchdog(hook_bound_s=5.0, poll_s=0.01)
    caplog.set_level(logging.WARNING, logger="kvtransfer.connector.watchdog")
    for _ in range(50):
        with watchdog.watch("get_transfer_results"):
            pass
    with watchdog.watch(LOAD_HOOK, bound_s=5.0, detail="request r1"):
        time.sleep(0.05)
    watchdog.check()
    assert watchdog.stalls == {} and watchdog.take_stalls() == {}
    assert not caplog.records
    watchdog.close()


def test_a_load_past_its_own_deadline_is_reported_with_its_request():
    watchdog = HookWatchdog(hook_bound_s=60.0, poll_s=0.02)
    release = threading.Event()

    def load() -> None:
        with watchdog.watch(LOAD_HOOK, bound_s=0.1, detail="request r7"):
            release.wait(10)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_until(lambda: watchdog.stalls.get(LOAD_HOOK) == 1, "the load counted", 10)
    finally:
        release.set()
        loader.join(10)
    assert watchdog.take_stalls() == {LOAD_HOOK: 1}
    watchdog.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hook_bound_s": 0}, "hook_bound_s must be a number of seconds > 0, got 0"),
        ({"hook_bound_s": "1"}, "hook_bound_s must be a number of seconds > 0, got '1'"),
        ({"hook_bound_s": True}, "hook_bound_s must be a number of seconds > 0, got True"),
        ({"step_bound_s": -1}, "step_bound_s must be a number of seconds > 0, got -1"),
        ({"watchdog_metrics_port": 0}, "watchdog_metrics_port must be a port (1-65535), got 0"),
        ({"watchdog_metrics_port": "9"}, "watchdog_metrics_port must be a port (1-65535), got '9'"),
        ({"thread_cpus": 3}, "thread_cpus must be a CPU list such as '2-3', got 3"),
        ({"thread_cpus": "3-1"}, "thread_cpus '3-1' is not a CPU list like '3' or '2-3'"),
        ({"thread_cpus": "a"}, "thread_cpus 'a' is not a CPU list like '3' or '2-3'"),
    ],
)
def test_bad_watchdog_settings_are_typed_errors_naming_the_key(extra, message):
    with pytest.raises(ValueError) as raised:
        WatchdogSettings.from_extra(extra)
    assert str(raised.value).startswith(message)


def test_watchdog_settings_defaults_and_values():
    assert WatchdogSettings.from_extra({}) == WatchdogSettings(1.0, None, None, 30.0)
    assert WatchdogSettings.from_extra(
        {
            "hook_bound_s": 2.5,
            "watchdog_metrics_port": 9400,
            "thread_cpus": "0,2-3",
            "step_bound_s": 45,
        }
    ) == WatchdogSettings(2.5, 9400, frozenset({0, 2, 3}), 45.0)


def test_kernel_names_fit_the_kernels_15_bytes():
    assert kernel_name("kvtransfer-ucx") == "kvtx-ucx"
    assert kernel_name("kvtransfer-ucx-notify") == "kvtx-ucx-notify"
    assert kernel_name("kvtransfer-serve-park") == "kvtx-serve-park"
    assert kernel_name("loop-a") == "kvtx-loop-a"
    assert len(kernel_name("kvtransfer-a-very-long-thread-name").encode()) == 15
    assert parse_cpus("1") == frozenset({1})


def _thread_facts() -> tuple[str, frozenset[int]]:
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm") as comm:
        name = comm.read().strip()
    return name, frozenset(os.sched_getaffinity(0))


def test_our_threads_name_themselves_and_move_onto_the_configured_cpus():
    first_cpu = min(os.sched_getaffinity(0))
    seen: dict[str, tuple[str, frozenset[int]]] = {}

    def run(label: str) -> None:
        enter_own_thread(f"kvtransfer-{label}")
        seen[label] = _thread_facts()

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=run, args=("plain",))
    thread.start()
    thread.join()
    assert seen["plain"] == ("kvtx-plain", frozenset(before))
    set_thread_cpus(frozenset({first_cpu}))
    try:
        thread = threading.Thread(target=run, args=("pinned",))
        thread.start()
        thread.join()
    finally:
        set_thread_cpus(None)
    assert seen["pinned"] == ("kvtx-pinned", frozenset({first_cpu}))
    # Only that thread moved: the process (this thread) keeps its CPUs.
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="thread_cpus names CPUs this machine does not have"):
        set_thread_cpus(frozenset({4096}))
