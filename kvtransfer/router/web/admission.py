"""`Admission`: at most ``max_running`` requests run at once; up to ``max_queued`` more wait for
a slot in arrival order; the next one is refused (`QueueFull`, 429 with ``Retry-After``).

A request waits no longer than its deadline (`QueueTimeout`, 503 with ``Retry-After``). A slot
is handed straight to the oldest waiter when a request ends, so a newcomer never overtakes the
queue. A waiter that leaves as a slot is handed to it, at its deadline or cancelled (its client
left) before it saw the slot, passes the slot on: no slot outlives its request.
``max_running`` 0 admits everything at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class QueueFull(Exception):
    """Every slot is taken and the queue is full."""


class QueueTimeout(Exception):
    """The request's deadline passed while it waited for a slot."""


class Admission:
    def __init__(
        self,
        max_running: int,
        max_queued: int,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_change = on_change

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self, deadline: float) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with``; raises `QueueFull` at once, or
        `QueueTimeout` at ``deadline`` (a `time.monotonic` instant)."""
        await self._acquire(deadline)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, deadline: float) -> None:
        if not self.max_running or (self.running < self.max_running and not self._waiters):
            self.running += 1
            self._changed()
            return
        if len(self._waiters) >= self.max_queued:
            raise QueueFull(
                f"{self.running} requests are running and {len(self._waiters)} waiting, this "
                "router's limits (--max-concurrent-requests, --max-queued-requests)"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._changed()
        try:
            # Not wait_for: on Python 3.11 it returns normally when a cancellation comes as the
            # slot is handed over, and a request whose client left would run on. asyncio.wait
            # ends on either, cancellation raised, and the waiter says whether a slot came.
            await asyncio.wait({waiter}, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._leave(waiter)
            raise
        # A slot that came as the deadline passed goes to a request with time left: this one
        # would only fail on its first upstream call.
        if not waiter.done() or time.monotonic() >= deadline:
            self._leave(waiter)
            raise QueueTimeout(
                "the request timed out waiting for admission (--max-concurrent-requests)"
            )

    def _leave(self, waiter: asyncio.Future[None]) -> None:
        """The request of ``waiter`` gives up waiting: a slot handed to it just now (before
        it could see it) goes on to the next waiter, or is freed."""
        if waiter.done():
            self._release()
            return
        waiter.cancel()
        self._waiters.remove(waiter)
        self._changed()

    def _release(self) -> None:
        # The slot passes to the oldest waiter still waiting; else it is free.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._changed()
                return
        self.running -= 1
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.running, len(self._waiters))
