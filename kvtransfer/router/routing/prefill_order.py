"""The order in which P/D requests reach the prefills when those are busy: `PrefillOrder`
(only with SLO targets; the router's ``--slo-ttft-ms``).

Why: a prefill computes prompts first come, first served. Offered more prompt tokens than it
computes, every request waits behind all earlier ones, and once that queue is longer than the
TTFT target every request misses it: goodput falls to almost nothing (measured: 15% of the
requests within the SLOs at 0.6 req/s on this project's 2-core machine, docs/benchmarks.md).

What it does instead: the router lets at most `DEPTH` requests per pickable prefill be sent on
(one computing, the next ready, so the prefill never waits for the router); the others wait in
the router. When a turn ends, the waiting request sent next is

1. of those that can still meet the TTFT target (now + the prompt's predicted prefill time,
   the best prefill's queue included, within the target of the request's arrival), the one
   with the fewest uncached tokens: the prefill's time then buys the most requests within it;
2. else (none can) the one waiting longest: a request already late is still served, in
   arrival order, whenever no request that can be on time waits.

A request whose prompt tokens the router does not know (a chat without ``--tokenizer``) counts
as in time while its wait alone allows, after every in-time request whose tokens are known.
With the prefills keeping up nothing waits, and the order is what it was. A request whose
client leaves while it waits leaves the queue (nothing was sent); one whose deadline passes
while it waits, or whose turn comes with less time left than its prompt needs there, fails
(`PrefillWaitTimeout`) without reaching a prefill. Limits: a prompt longer than
the prefills can compute within the target waits behind every shorter one while the load
lasts (docs/limits.md).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

# Requests per pickable prefill sent on at once: one computing, one ready behind it.
DEPTH = 2

# How a request was sent on: at once (a turn was free), in time (it could still meet the
# TTFT target) or late (it could not); or that it ran out of time waiting (`PrefillWaitTimeout`).
# The ``order`` label of kvtransfer_router_prefill_wait_seconds.
AT_ONCE = "at_once"
IN_TIME = "in_time"
LATE = "late"
TIMED_OUT = "timed_out"

# The predicted prefill time of a prompt of so many uncached tokens on the best prefill now,
# its queue included (None: not measured yet).
Predictor = Callable[[int], "float | None"]


@dataclass(eq=False)
class _Waiting:
    tokens: int | None  # None: not known
    arrived: float
    seq: int
    sent: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PrefillWaitTimeout(Exception):
    """A held request ran out of time before it could be sent on to a prefill."""


class PrefillOrder:
    """The turns of one router flow's P/D requests at its prefills (see the module)."""

    def __init__(
        self,
        ttft_s: float,
        on_change: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_change(inside, waiting)``: called whenever either changes (metrics)."""
        if not ttft_s > 0:
            raise ValueError(f"the TTFT target must be > 0 s, got {ttft_s!r}")
        self.ttft_s = ttft_s
        self._on_change = on_change
        self._clock = clock
        self._seq = itertools.count()
        self._waiting: list[_Waiting] = []
        self._inside = 0
        self._slots = 0
        self._predict: Predictor = lambda tokens: None

    @property
    def inside(self) -> int:
        """Requests sent on and not done."""
        return self._inside

    @property
    def waiting(self) -> int:
        """Requests waiting for their turn."""
        return len(self._waiting)

    def tokens_ahead(self, tokens: int) -> int:
        """The uncached tokens of the waiting requests a new one of ``tokens`` would wait
        behind while it can still be on time: those with no more tokens than it."""
        return sum(w.tokens for w in self._waiting if w.tokens is not None and w.tokens <= tokens)

    @property
    def waiting_tokens(self) -> int:
        """The uncached tokens of every waiting request (those the router knows)."""
        return sum(w.tokens or 0 for w in self._waiting)

    @asynccontextmanager
    async def turn(
        self,
        tokens: int | None,
        arrived: float,
        deadline: float,
        slots: int,
        predict: Predictor,
    ) -> AsyncIterator[str]:
        """Wait for this request's turn at the prefills, and hold it until the block ends.
        ``tokens``: its uncached prompt tokens (None: not known); ``arrived`` and
        ``deadline``: when the router took it and when it must have ended (this clock);
        ``slots``: requests the prefills take at once now (`DEPTH` x the pickable prefills; 0:
        no prefill, nothing is held back); ``predict``: see `Predictor`. Yields how it was sent
        on (`AT_ONCE`, `IN_TIME` or `LATE`). Raises `PrefillWaitTimeout` when the request's
        deadline passes while it waits, or when its turn comes with less time left than its
        predicted prefill time: sent on, its call would only run out of time there, and a
        prefill whose call timed out before answering is taken for unhealthy."""
        self._slots, self._predict = slots, predict
        # Turns a new prefill brought go to those already waiting first.
        self._send()
        if slots <= 0 or (self._inside < slots and not self._waiting):
            self._inside += 1
            self._changed()
            order = AT_ONCE
        else:
            tokens = None if tokens is None else max(0, tokens)
            order = await self._wait(_Waiting(tokens, arrived, next(self._seq)), deadline)
        try:
            yield order
        finally:
            self._inside -= 1
            self._send()

    async def _wait(self, waiting: _Waiting, deadline: float) -> str:
        self._waiting.append(waiting)
        try:
            self._changed()
            # asyncio.wait, not wait_for: it ends on the turn, the deadline or a cancellation
            # alike, and the future then says whether the turn came (see web.admission).
            await asyncio.wait({waiting.sent}, timeout=max(0.0, deadline - self._clock()))
        except BaseException:
            self._leave(waiting)
            raise
        left = deadline - self._clock()
        if not waiting.sent.done() or left <= 0:
            self._leave(waiting)
            raise PrefillWaitTimeout(
                "the request's deadline passed while it waited for a turn at the busy prefills "
                f"({self.waiting} other(s) waiting)"
            )
        needed = self._predict(waiting.tokens or 0)
        if needed is not None and left < needed:
            self._leave(waiting)
            raise PrefillWaitTimeout(
                f"its turn at the prefills came with {max(0.0, left):.1f} s left before the "
                f"request's deadline, and its prompt needs about {needed:.1f} s there"
            )
        return waiting.sent.result()

    def _leave(self, waiting: _Waiting) -> None:
        """``waiting``'s request gives up (its client left, its deadline): a turn given to it
        just now goes on to the next request."""
        if waiting.sent.done():
            self._inside -= 1
            self._send()
            return
        waiting.sent.cancel()
        self._waiting.remove(waiting)
        self._changed()

    def _send(self) -> None:
        """Send on waiting requests while turns are free, each the best of those waiting."""
        while self._waiting and (self._slots <= 0 or self._inside < self._slots):
            waiting, order = self._next()
            self._waiting.remove(waiting)
            self._inside += 1
            waiting.sent.set_result(order)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._inside, len(self._waiting))

    def _next(self) -> tuple[_Waiting, str]:
        now = self._clock()
        in_time = []
        for w in self._waiting:
            seconds = self._predict(w.tokens or 0)
            if seconds is None:
                # Nothing measured yet: arrival order.
                return min(self._waiting, key=lambda w: w.seq), IN_TIME
            if now + seconds <= w.arrived + self.ttft_s:
                in_time.append(w)
        if in_time:
            return min(in_time, key=_fewest_tokens_first), IN_TIME
        return min(self._waiting, key=lambda w: w.seq), LATE


def _fewest_tokens_first(waiting: _Waiting) -> tuple[float, int]:
    return (float("inf") if waiting.tokens is None else waiting.tokens, waiting.seq)
