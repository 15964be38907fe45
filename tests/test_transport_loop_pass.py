"""One pass of `UcxLoop`'s progress thread is bounded: at most `_MAX_PROGRESS_PER_PASS` (64)
``progress_once`` calls, then it probes its listeners, completes and expires requests, and runs
the calls queued meanwhile, however long UCX keeps saying it progressed something.

The loop here has no UCX under it: a fake worker whose ``progress_once`` always reports more
work (a transport moving a long message), in a loop object built without `UcxLoop.__init__`
(which would create a UCX context). A loop without the cap never leaves its first pass: the fake
worker stops it with an error after far more calls than any pass may make, so such a loop fails
these tests instead of hanging them.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from kvtransfer.transport import ucx as ucx_module
from kvtransfer.transport.ucx import UcxLoop

pytestmark = pytest.mark.unit

CAP = ucx_module._MAX_PROGRESS_PER_PASS
# Far more progress calls than one pass may make: past it, the fake worker refuses to go on.
RUNAWAY = 100 * CAP
WAIT_S = 30.0


class _ProgressForever:
    """A UCX worker that always has more work: every ``progress_once`` says it progressed."""

    def __init__(self) -> None:
        self.calls = 0
        # Progress calls made in each pass, split where the loop did something else.
        self.runs: list[int] = [0]
        self.probes = 0

    def progress_once(self) -> bool:
        self.calls += 1
        self.runs[-1] += 1
        if self.runs[-1] > RUNAWAY:
            raise RuntimeError(f"{self.runs[-1]} progress calls without leaving the pass")
        return True

    def other_duty(self) -> None:
        if self.runs[-1]:
            self.runs.append(0)

    def tag_probe(self, *args: Any) -> Any:
        self.probes += 1
        self.other_duty()
        return SimpleNamespace(matched=False)

    def arm(self) -> bool:
        return False  # busy: UCX cannot be armed while it has work

    def cancel_inflight_requests(self) -> None:
        pass


class _Completed:
    completed = True

    def check_error(self) -> None:
        pass


def _bare_loop(worker: _ProgressForever) -> UcxLoop:
    """A `UcxLoop` over ``worker``, with what its thread uses, without UCX."""
    loop = UcxLoop.__new__(UcxLoop)
    loop._ucx = SimpleNamespace(UCXXTag=lambda tag: tag, UCXXTagMaskFull=None)
    loop._worker = worker
    loop._listeners = {}
    loop._tracked = []
    loop._deadlines = []
    loop._deadline_seq = itertools.count()
    loop._lock = threading.Lock()
    loop._calls = deque()
    loop._closing = False
    loop._endpoints = {}
    loop._handles = {}
    loop._close_hooks = {}
    loop.name = "loop-pass-test"
    loop.busy_naps = loop.idle_naps = 0
    loop._wake_r, loop._wake_w = os.pipe()
    os.set_blocking(loop._wake_r, False)
    os.set_blocking(loop._wake_w, False)
    loop._poller = select.poll()
    loop._poller.register(loop._wake_r, select.POLLIN)
    loop._wake_poller = select.poll()
    loop._wake_poller.register(loop._wake_r, select.POLLIN)
    return loop


def test_one_pass_makes_at_most_the_cap_of_progress_calls_then_does_its_other_duties():
    worker = _ProgressForever()
    loop = _bare_loop(worker)
    try:
        completions: list[BaseException | None] = []
        expired: list[str] = []
        # A listener to probe, a request that completed, one whose deadline passed.
        loop.listen(7, lambda data, error: None)
        loop._track(_Completed(), (), completions.append, None, None)
        loop._track(
            SimpleNamespace(completed=False), (), None, 0.0, lambda: expired.append("timed out")
        )
        progressed, ours = loop._progress()
        assert worker.calls == CAP == 64
        assert progressed
        # Its other duties, in the same pass.
        assert worker.probes == 1
        assert completions == [None]
        assert expired == ["timed out"]
        assert ours == 2
        # The next pass again stops at the cap.
        loop._progress()
        assert worker.calls == 2 * CAP
    finally:
        os.close(loop._wake_r)
        os.close(loop._wake_w)


def test_the_loop_thread_serves_its_calls_while_ucx_claims_work_forever():
    """The thread itself: calls queued while every pass is all progress are still run, each
    after at most one capped run of progress calls."""
    worker = _ProgressForever()
    loop = _bare_loop(worker)
    # Probed once per pass, after its progress calls: marks where each pass's run ends.
    loop.listen(7, lambda data, error: None)
    loop._thread = threading.Thread(target=loop._run, name=loop.name, daemon=True)
    loop._thread.start()
    try:
        for i in range(5):

            def observe(i: int = i) -> tuple[int, int]:
                worker.other_duty()  # a call ran: a new run of progress calls starts
                return i, worker.calls

            assert loop.call(observe).result(WAIT_S)[0] == i
        assert loop._thread.is_alive(), "the loop thread died (a pass never ended?)"
        # Between any two other duties (a call run, a probe), at most the cap.
        assert worker.calls > 0
        assert max(worker.runs) <= CAP, worker.runs
    finally:
        loop.close(WAIT_S)
    assert not loop._thread.is_alive()
