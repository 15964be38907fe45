"""`UcxLoop`'s progress thread never holds a core: when UCX cannot be armed (work its
descriptor will not announce), it spins briefly and then naps, still serving its queue.

The TP 1 -> TP 2 vLLM stall of issue 27: a producer's loop whose UCX stayed busy ran at 100% of
core 0 for minutes, and the consumer's TP rank 0, pinned to core 0 as well, never ran."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvtransfer.transport.ucx import UcxLoop

pytestmark = pytest.mark.integration


class _NeverArmed:
    """A UCX worker that always has unannounced work (``arm`` answers busy)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def arm(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


def _thread_cpu_s(loop: UcxLoop) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(loop._thread.ident))


def test_a_loop_that_cannot_arm_naps_and_still_serves_its_queue():
    loop = UcxLoop(name="never-armed")
    real = loop._worker
    try:
        loop._worker = _NeverArmed(real)
        assert loop.call(lambda: 42).result(5) == 42
        cpu_before, naps_before = _thread_cpu_s(loop), loop.busy_naps
        time.sleep(1.0)
        cpu_s = _thread_cpu_s(loop) - cpu_before
        # Spinning, the thread would use the whole second (or all the core it is given);
        # napping 1 ms per pass it uses a small part of it.
        assert cpu_s < 0.5, f"the loop used {cpu_s:.2f} s of CPU in 1 s"
        assert loop.busy_naps - naps_before > 100
        assert loop.call(lambda: "still serving").result(5) == "still serving"
    finally:
        loop._worker = real
        loop.close()
