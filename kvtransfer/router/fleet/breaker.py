"""`CircuitBreaker`: one per instance.

Circuit breaker (`CircuitBreaker`, one per instance). A daemon that answers its health checks
but fails every call is not ejected by them; the breaker takes it out: after ``failures``
consecutive failed calls (5xx outcomes of its own: transport errors, error finishes, unusable
answers) it opens, and the instance is not picked for ``cooldown_s``; then it is half-open: it
may be picked while it has no request in flight (one trial at a time); a success closes the
breaker, a failure opens it again. Refusals of the input (4xx) count neither way. The failures
belong to a process: when ``GetStatus`` shows the daemon's uptime went back (it restarted), its
breaker closes at once instead of waiting out the cooldown (a restarted daemon took 30 s to get
traffic again); a daemon that crash-loops costs at most ``failures`` calls per start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive failures (0: never) -> half-open after
    ``cooldown_s`` -> closed on a success, open again on a failure."""

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._state = CLOSED
        self._opened_at = 0.0
        self.consecutive_failures = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self._cooldown_s:
            self._become(HALF_OPEN)
        return self._state

    def allows(self, in_flight: int) -> bool:
        """Whether a call may go through now; half-open lets one through at a time."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and in_flight == 0)

    def reset(self) -> None:
        """Forget the failures (they were another process's): closed."""
        self.consecutive_failures = 0
        if self._state != CLOSED:
            self._become(CLOSED)

    def success(self) -> None:
        self.consecutive_failures = 0
        if self.state != CLOSED:
            self._become(CLOSED)

    def failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state == HALF_OPEN or (
            state == CLOSED and self._threshold and self.consecutive_failures >= self._threshold
        ):
            self._opened_at = self._clock()
            self._become(OPEN)

    def _become(self, state: str) -> None:
        self._state = state
        if self._on_change is not None:
            self._on_change(state)
