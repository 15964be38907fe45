"""The admission queue's hand-over of a slot to a waiter that is leaving at that very moment
(`kvtransfer.router.web.admission`): cancelled in the loop iteration that hands it the slot, or
at its deadline. Each test orders the events within one loop iteration (no sleeps): the slot
is never lost nor held by a request that left, and at the end nothing runs, nothing waits,
and a new request is admitted at once. In order, refusals, plain timeouts:
tests/test_router_policy.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvtransfer.router.web.admission import Admission, QueueTimeout

pytestmark = pytest.mark.unit

FAR = 3600.0  # seconds: a deadline no test reaches


@dataclass
class Queue:
    """An `Admission` of one slot whose changes a test can wait for, and requests whose
    bodies record that they ran and then wait to be let go."""

    admission: Admission = field(init=False)
    ran: list[str] = field(default_factory=list)
    someone_ran: asyncio.Event = field(default_factory=asyncio.Event)
    started: dict[str, asyncio.Event] = field(default_factory=dict)
    let_go: dict[str, asyncio.Event] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.admission = Admission(1, 8, on_change=lambda running, queued: self._changed.set())

    async def queued(self, count: int) -> None:
        """Returns once ``count`` requests wait."""
        while self.admission.queued != count:
            self._changed.clear()
            await self._changed.wait()

    def request(self, name: str, deadline: float | None = None) -> asyncio.Task[None]:
        self.started[name] = asyncio.Event()
        self.let_go[name] = asyncio.Event()

        async def run() -> None:
            async with self.admission.slot(deadline or time.monotonic() + FAR):
                self.ran.append(name)
                self.started[name].set()
                self.someone_ran.set()
                await self.let_go[name].wait()

        return asyncio.create_task(run(), name=name)

    async def finish(self, *tasks: asyncio.Task[None]) -> None:
        """Lets every request go, waits for ``tasks``; then nothing runs or waits, and a
        request with no time to wait is admitted."""
        for event in self.let_go.values():
            event.set()
        await asyncio.wait(tasks)
        assert (self.admission.running, self.admission.queued) == (0, 0)
        async with self.admission.slot(time.monotonic()):
            assert self.admission.running == 1
        assert self.admission.running == 0


def scenario_run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("order", ["handed-then-cancelled", "cancelled-then-handed"])
def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_iteration_goes_to_the_next(
    order: str,
) -> None:
    async def scenario() -> None:
        q = Queue()
        async with q.admission.slot(time.monotonic() + FAR):
            a, b = q.request("a"), q.request("b")
            await q.queued(2)
            if order == "cancelled-then-handed":
                a.cancel()
            # Leaving the block hands the slot to "a" without yielding to the loop: "a" has
            # not run since, whichever came first.
        if order == "handed-then-cancelled":
            a.cancel()
        await q.someone_ran.wait()
        assert q.ran == ["b"]
        assert a.cancelled()
        assert (q.admission.running, q.admission.queued) == (1, 0)
        await q.finish(a, b)

    scenario_run(scenario)


def test_a_slot_handed_over_as_the_waiters_deadline_comes_goes_to_the_next() -> None:
    async def scenario() -> None:
        q = Queue()
        async with q.admission.slot(time.monotonic() + FAR):
            # "a" has no time left: its wait ends in the next loop iteration, the one in which
            # leaving the block hands it the slot.
            a, b = q.request("a", deadline=time.monotonic()), q.request("b")
            await q.queued(2)
        with pytest.raises(QueueTimeout, match="timed out waiting for admission"):
            await a
        await q.someone_ran.wait()
        assert q.ran == ["b"]
        assert (q.admission.running, q.admission.queued) == (1, 0)
        await q.finish(a, b)

    scenario_run(scenario)


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_slot() -> None:
    async def scenario() -> None:
        q = Queue()
        async with q.admission.slot(time.monotonic() + FAR):
            a, b, c = q.request("a"), q.request("b"), q.request("c")
            await q.queued(3)
            b.cancel()
            await asyncio.wait({b})
            assert b.cancelled()
            assert (q.admission.running, q.admission.queued) == (1, 2)
        await q.someone_ran.wait()
        assert q.ran == ["a"]
        q.let_go["a"].set()
        await a
        await q.started["c"].wait()
        assert q.ran == ["a", "c"]
        await q.finish(a, b, c)

    scenario_run(scenario)


def test_a_waiter_past_its_deadline_times_out_and_leaves_the_queue() -> None:
    async def scenario() -> None:
        q = Queue()
        async with q.admission.slot(time.monotonic() + FAR):
            a = q.request("a", deadline=time.monotonic())
            with pytest.raises(QueueTimeout, match="timed out waiting for admission"):
                await a
            assert (q.admission.running, q.admission.queued) == (1, 0)
        assert q.ran == []
        await q.finish(a)

    scenario_run(scenario)
