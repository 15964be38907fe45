"""`wait_until`: the one way tests wait for another process or thread to reach a state.

Tests never sleep a fixed time to let something happen: they poll what they need to see, and
fail with the thing they waited for and the last value seen when it does not come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.02


class WaitTimeout(AssertionError):
    """What a test waited for did not happen in time (an assertion failure, not an error)."""


def _named(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


def wait_until(
    predicate: Callable[[], T],
    what: str | Callable[[], str],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = POLL_INTERVAL_S,
) -> T:
    """Call ``predicate`` until it returns something truthy and return that value.

    Raises `WaitTimeout` naming ``what`` and the last value after ``timeout`` seconds; ``what``
    may be a function, called at the timeout to describe what was seen (a log's tail, ...).
    Exceptions from ``predicate`` propagate (a broken probe is not a slow one).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{_named(what)}: not within {timeout:g} s (last value {value!r})")
        time.sleep(interval)


def seconds_until(
    predicate: Callable[[], object],
    what: str | Callable[[], str],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = POLL_INTERVAL_S,
) -> float:
    """`wait_until`, returning how many seconds the wait took (for tests that bound a latency)."""
    started = time.monotonic()
    wait_until(predicate, what, timeout, interval=interval)
    return time.monotonic() - started


def step_until(
    step: Callable[[], object],
    condition: Callable[[], object],
    what: str | Callable[[], str],
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """`wait_until` for a loop the test drives itself (an engine's ``step``): checks
    ``condition`` and calls ``step`` until it holds, with no pause between steps."""

    def reached() -> bool:
        if condition():
            return True
        step()
        return False

    wait_until(reached, what, timeout, interval=0)


async def wait_until_async(
    predicate: Callable[[], Awaitable[T]],
    what: str | Callable[[], str],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = POLL_INTERVAL_S,
) -> T:
    """`wait_until` for a coroutine predicate, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{_named(what)}: not within {timeout:g} s (last value {value!r})")
        await asyncio.sleep(interval)
