"""`Wakeup`: an idle engine's wait ends when a connector signals, from another thread or another
process, or when an interrupt is set; wake-ups are consumed, so the next wait waits again."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from kvtransfer.engine.wakeup import WakeSignal, Wakeup

pytestmark = pytest.mark.integration

# Far above any wake-up latency: a wait that ends sooner was woken, not timed out.
LONG_S = 30.0


def _signal_from_child(signal: WakeSignal) -> None:
    signal()


def test_a_signal_from_another_thread_ends_the_wait_and_is_consumed():
    wakeup = Wakeup()
    threading.Timer(0.05, wakeup.signal).start()
    started = time.monotonic()
    wakeup.wait(LONG_S)
    assert time.monotonic() - started < LONG_S / 2
    assert wakeup.drain() is False  # consumed by the wait
    wakeup.wait(0.01)  # nothing pending: waits out its timeout, no error


def test_a_signal_from_a_spawned_process_ends_the_wait():
    wakeup = Wakeup()
    child = mp.get_context("spawn").Process(target=_signal_from_child, args=(wakeup.signal,))
    child.start()
    started = time.monotonic()
    wakeup.wait(LONG_S)
    child.join(LONG_S)
    assert child.exitcode == 0
    assert time.monotonic() - started < LONG_S / 2


def test_an_interrupt_ends_the_wait_and_is_left_to_its_owner():
    kv_events, interrupt = Wakeup(), Wakeup()
    interrupt.set()
    started = time.monotonic()
    kv_events.wait(LONG_S, [interrupt])
    assert time.monotonic() - started < LONG_S / 2
    assert interrupt.drain() is True
    assert interrupt.drain() is False


def test_a_signal_after_the_reader_closed_is_ignored():
    wakeup = Wakeup()
    wakeup.close()
    wakeup.signal()  # an engine shutting down: no error in the connector's thread


def test_engines_sleep_until_woken_only_when_every_connector_wakes_them(tmp_path):
    from engine_helpers.builtin import engine_config
    from shared_storage_helpers.engines import kv_config

    from kvtransfer.connector.config import KVTransferConfig
    from kvtransfer.engine.engine_core import EngineCore

    polled = KVTransferConfig(
        kv_connector="KVConnectorBase_V1",
        kv_connector_module_path="kvtransfer.connector.base",
        kv_role="kv_both",
    )
    for kv, wakes in [
        (None, True),
        (kv_config(tmp_path, "kv_both", "e"), True),
        (polled, False),  # the base class offers no callback: it is polled
    ]:
        with EngineCore(engine_config(kv)) as core:
            assert core.wakes_on_kv_events is wakes, kv


def test_a_completion_queue_wakes_the_engine_on_every_result_and_drains_in_order():
    from kvtransfer.connector.completions import CompletionQueue

    woken: list[int] = []
    results: CompletionQueue[str] = CompletionQueue()
    results.put("before any callback")  # queued, nobody to wake yet
    assert results.set_callback(lambda: woken.append(1)) is True
    threads = [threading.Thread(target=results.put, args=(f"load-{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    drained = results.drain()
    assert drained[0] == "before any callback"
    assert sorted(drained[1:]) == ["load-0", "load-1", "load-2"]
    assert len(woken) == 3 and results.drain() == []
