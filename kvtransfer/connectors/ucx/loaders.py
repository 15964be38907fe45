"""The consumer worker's loader threads, all started before the first step.

A `ThreadPoolExecutor` starts its threads on `submit`, and starting a thread waits until the
new thread runs. `start_load_kv` submits each load inside vLLM's step, so on a core starved by
other engines that wait held the step: the watchdog caught `start_load_kv` blocked 8.6 s in
``ThreadPoolExecutor._adjust_thread_count`` (issue 34). Here every thread exists before the
first step, and submitting is a queue put.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvtransfer.threads import enter_own_thread

logger = logging.getLogger(__name__)


class LoaderThreads:
    """``count`` threads running submitted jobs in order of submission."""

    def __init__(self, count: int, name: str = "kvtransfer-load") -> None:
        if count < 1:
            raise ValueError(f"max_concurrent_loads must be at least 1, got {count}")
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the next free thread; never blocks."""
        self._jobs.put(job)

    def close(self) -> None:
        """Let the jobs already submitted finish, then stop every thread; idempotent."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _work(self) -> None:
        enter_own_thread(self._name)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                logger.exception("a KV load job failed outside its own error handling")
