"""`UcxLoop`'s progress thread never holds a core while nothing moves, whatever UCX reports.

Three ways UCX can keep a loop awake for nothing, each tested against a real UCX worker wrapped
to misbehave:

* it cannot be armed (work its descriptor will not announce): issue 27's stall, where a
  producer's loop at 100% of core 0 kept the consumer's TP rank 0, pinned there too, from
  running;
* it arms, but its event descriptor stays readable, so every ``poll`` returns at once: issue
  34's stall, caught with py-spy (the producer's ``kvtransfer-ucx`` thread at 83% of core 0 in
  the armed branch), which the nap of issue 27 never reached;
* its progress claims work forever while none of ours completes.

In each case the loop naps on its wake-up pipe alone: its thread uses a small share of the
second it is watched, it still serves calls at once, and real messages still flow.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvtransfer.transport.ucx import UcxLoop

pytestmark = pytest.mark.integration

# A spinning thread uses the whole watched second (or all the core it gets); a napping one a
# few percent. The bound leaves room for a slow, shared CI machine.
_MAX_CPU_SHARE = 0.25


class _Misbehaving:
    """A real UCX worker, except for what the test overrides."""

    def __init__(self, worker: Any, *, arms: bool = True, progress_claims: bool = False):
        self._worker = worker
        self._arms = arms
        self._claims = progress_claims

    def arm(self) -> bool:
        return self._worker.arm() and self._arms

    def progress_once(self) -> bool:
        return self._worker.progress_once() or self._claims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


class _ReadableForever:
    """What the loop polls: its wake-up pipe and, in place of UCX's event descriptor, a pipe
    that always holds a byte (so ``poll`` always says it is readable)."""

    def __init__(self, loop: UcxLoop) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.write(self.write_fd, b"!")
        self.poller = select.poll()
        self.poller.register(self.read_fd, select.POLLIN)
        self.poller.register(loop._wake_r, select.POLLIN)
        self.polls = 0

    def poll(self, timeout_ms: float) -> list[tuple[int, int]]:
        self.polls += 1
        return self.poller.poll(timeout_ms)

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def _thread_cpu_s(loop: UcxLoop) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(loop._thread.ident))


def _cpu_share_over(loop: UcxLoop, seconds: float) -> float:
    before = _thread_cpu_s(loop)
    time.sleep(seconds)
    return (_thread_cpu_s(loop) - before) / seconds


def _swap_on_loop(loop: UcxLoop, **attributes: Any) -> dict[str, Any]:
    """Set attributes of the loop from its own thread (it reads them there); the old values."""

    def swap() -> dict[str, Any]:
        old = {name: getattr(loop, name) for name in attributes}
        for name, value in attributes.items():
            setattr(loop, name, value)
        return old

    return loop.call(swap).result(5)


def _round_trip(a: UcxLoop, b: UcxLoop) -> bytes:
    """One tagged message from ``a`` to ``b``: the bytes ``b`` received."""
    sent = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
    got = np.zeros_like(sent)
    done = threading.Event()
    errors: list[BaseException | None] = []

    def received(error: BaseException | None) -> None:
        errors.append(error)
        done.set()

    b.call(lambda: b.recv(a.address, got, 11, received, timeout_s=10)).result(5)
    a.call(lambda: a.send(b.address, sent, 11)).result(5)
    assert done.wait(10) and errors == [None]
    assert got.tobytes() == sent.tobytes()
    return got.tobytes()


@pytest.fixture
def loops():
    a, b = UcxLoop(name="loop-a"), UcxLoop(name="loop-b")
    yield a, b
    a.close()
    b.close()


def test_a_loop_that_cannot_arm_naps_and_still_serves_its_queue(loops):
    loop, _ = loops
    real = _swap_on_loop(loop, _worker=_Misbehaving(loop._worker, arms=False))["_worker"]
    try:
        naps_before = loop.busy_naps
        share = _cpu_share_over(loop, 1.0)
        assert share < _MAX_CPU_SHARE, f"the loop used {share:.0%} of a core"
        assert loop.busy_naps - naps_before > 100
        assert loop.call(lambda: "still serving").result(5) == "still serving"
    finally:
        _swap_on_loop(loop, _worker=real)


def test_an_armed_loop_whose_descriptor_stays_readable_naps_and_still_moves_messages(loops):
    loop, peer = loops
    _round_trip(loop, peer)  # an endpoint each way, as a producer has
    readable = _ReadableForever(loop)
    real = _swap_on_loop(loop, _poller=readable)["_poller"]
    try:
        naps_before = loop.idle_naps
        share = _cpu_share_over(loop, 1.0)
        assert share < _MAX_CPU_SHARE, f"the loop used {share:.0%} of a core"
        # It naps instead of polling: a spinning loop would poll hundreds of thousands of
        # times a second; napping 1 ms per pass, at most about a thousand.
        assert loop.idle_naps - naps_before > 100
        assert readable.polls < 5_000, f"{readable.polls} polls in about a second"
        started = time.monotonic()
        assert loop.call(lambda: "served").result(5) == "served"
        # A queued call ends a nap (the wake-up pipe is still watched): not a timing claim,
        # just that it was not left for the next deadline check (a second away).
        assert time.monotonic() - started < 0.5
        # Real traffic both ways still flows while the descriptor lies.
        _round_trip(loop, peer)
        _round_trip(peer, loop)
    finally:
        _swap_on_loop(loop, _poller=real)
        readable.close()
    # Once the descriptor is quiet again the loop sleeps for real: no more naps.
    time.sleep(0.2)
    naps = loop.idle_naps
    share = _cpu_share_over(loop, 1.0)
    assert loop.idle_naps - naps <= 2 and share < 0.05, (loop.idle_naps - naps, share)


def test_a_worker_claiming_progress_forever_is_bounded_too(loops):
    loop, peer = loops
    _round_trip(loop, peer)  # endpoints are made on the real worker
    readable = _ReadableForever(loop)
    claiming = _Misbehaving(loop._worker, progress_claims=True)
    real = _swap_on_loop(loop, _worker=claiming, _poller=readable)
    try:
        # It is believed for a while (a transport moving a long message), then napped on.
        time.sleep(2.5)
        share = _cpu_share_over(loop, 1.0)
        assert share < _MAX_CPU_SHARE, f"the loop used {share:.0%} of a core"
        _round_trip(peer, loop)
    finally:
        _swap_on_loop(loop, **real)
        readable.close()


def test_an_idle_loop_sleeps(loops):
    loop, peer = loops
    _round_trip(loop, peer)
    share = _cpu_share_over(loop, 1.0)
    assert share < 0.05, f"an idle loop used {share:.0%} of a core"
    assert loop.busy_naps == 0
