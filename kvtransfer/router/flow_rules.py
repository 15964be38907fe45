"""What both P/D flows (kvtransfer daemons over gRPC, vLLM servers over HTTP) decide alike:
whether a request is disaggregated or runs on one instance alone (`RouteDecider`: with SLO
targets the fleet's mode first, `routing.fleet_mode`, scored by each request's `SloOutcome`;
then the fleet's view and the arrival rate handed to `routing.disagg.decide`), when a P/D
request is sent on to the prefills (`RouteDecider.prefill_turn`, with SLO targets:
`routing.prefill_order`) and how long to wait before a retry on another instance
(`retry_pause`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import TIMEOUT, UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.fleet.service import ArrivalRate
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.routing.disagg import (
    DisaggRule,
    RouteDecision,
    SloTargets,
    decide,
    prefill_s,
)
from kvtransfer.router.routing.fleet_mode import (
    AGGREGATED_FLEET,
    FleetMode,
    FleetTicket,
    aggregated_fits,
    aggregated_gap_s,
    aggregated_route,
)
from kvtransfer.router.routing.policy import RouteContext
from kvtransfer.router.routing.prefill_order import (
    AT_ONCE,
    DEPTH,
    TIMED_OUT,
    PrefillOrder,
    PrefillWaitTimeout,
)

logger = logging.getLogger(__name__)

# Back-off before retry n: RETRY_BACKOFF_S * 2**(n-1), at most RETRY_MAX_BACKOFF_S, +-20%.
RETRY_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0
# Weight of the newest prompt in the mean prompt length the fleet's mode estimates from.
FLEET_EWMA = 0.1


class RouteDecider:
    """One flow's route decisions: its rule (from the config), the arrival rate it saw and,
    with SLO targets, the order of its P/D requests at busy prefills."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.rule = DisaggRule.of(config)
        self.arrivals = ArrivalRate()
        self.metrics = metrics
        self.order = None
        self.fleet_mode: FleetMode | None = None
        # The mean prompt length of the requests routed (tokens): the offered prompt work.
        self._prompt_tokens = 0.0
        if self.rule.slo is not None:
            self.order = PrefillOrder(self.rule.slo.ttft_s, metrics.prefill_order_state)
            self.fleet_mode = FleetMode(
                time.monotonic, metrics.fleet_mode_switch, metrics.fleet_duel
            )

    def decide(self, fleet: Fleet, route: RouteContext, max_tokens: int) -> RouteDecision:
        """The route of one request, from the fleet's pickable instances now."""
        self.arrivals.arrived()
        if route.token_ids is not None:
            self._prompt_tokens += FLEET_EWMA * (len(route.token_ids) - self._prompt_tokens)
        pickable = [i for i in fleet.instances() if i.pickable()]
        prefills = [i for i in pickable if i.role == "prefill"]
        decodes = [i for i in pickable if i.role == "decode" and not i.aggregated]
        slo, fleet_mode = self.rule.slo, self.fleet_mode
        if slo is not None and fleet_mode is not None and prefills and decodes:

            def fits() -> bool:
                gap = aggregated_gap_s(prefills, decodes, self._load(prefills))
                return aggregated_fits(gap, slo)

            if fleet_mode.current(fits) == AGGREGATED_FLEET:
                return aggregated_route(prefills, decodes)
        decision = decide(
            self.rule,
            route,
            max_tokens,
            prefills,
            decodes,
            fleet.policies["decode"],
            self.arrivals.per_s,
            self.order,
        )
        if decision.predicted:
            logger.debug("%s: %s", route.request_id, decision.describe())
        return decision

    def _load(self, prefills: list[Instance]) -> float:
        """Seconds of prompt compute arriving per second, at the prefills' best measured rate
        (0 before one was measured)."""
        rates = [p.service.prompt_tokens_per_s or 0.0 for p in prefills]
        rate = max(rates, default=0.0)
        return self.arrivals.per_s * self._prompt_tokens / rate if rate else 0.0

    def track(self, started: float) -> SloOutcome:
        """The outcome of a request just routed (``started``: when it came,
        `time.monotonic`), for the fleet's mode: a flow reports its tokens and its end."""
        return SloOutcome(self.fleet_mode, self.rule.slo, started)

    @asynccontextmanager
    async def prefill_turn(
        self, fleet: Fleet, decision: RouteDecision | None, started: float, deadline: float
    ) -> AsyncIterator[None]:
        """Hold a P/D request until its turn at the prefills (`routing.prefill_order`; without
        SLO targets at once), for the block: its prefill, retries included. ``started`` and
        ``deadline``: the request's (`time.monotonic`). Raises `UpstreamError` (503, the
        request's timeout) when its time runs out while it is held, before any prefill call."""
        if self.order is None:
            yield
            return
        prefills = [i for i in fleet.instances() if i.pickable() and i.role == "prefill"]
        tokens = None if decision is None else decision.uncached_tokens
        waited = time.monotonic()
        turn = self.order.turn(
            tokens, started, deadline, DEPTH * len(prefills), lambda n: prefill_s(prefills, n)
        )
        try:
            async with turn as how:
                self.metrics.prefill_order(how, time.monotonic() - waited)
                if how != AT_ONCE:
                    logger.debug("sent on to a prefill %s, %s tokens", how, tokens)
                yield
        except PrefillWaitTimeout as exc:  # raised by the wait only, before any prefill call
            self.metrics.prefill_order(TIMED_OUT, time.monotonic() - waited)
            text = f"{exc} (--request-timeout-s)"
            raise UpstreamError(503, str(exc), "prefill", "-", TIMEOUT, text=text) from None


class SloOutcome:
    """Scores one request for `FleetMode` by the router's clock: met when its first token came
    within the TTFT target and the mean gap from its first token to its last is within the gap
    target. Without SLO targets it does nothing (flows call it all the same)."""

    def __init__(self, mode: FleetMode | None, slo: SloTargets | None, started: float) -> None:
        self._mode = mode if slo is not None else None
        self._slo = slo
        self._started = started
        self._ticket: FleetTicket | None = None if self._mode is None else self._mode.admit()
        self._first: float | None = None
        self._last = 0.0
        self._after_first = 0

    def tokens(self, count: int) -> None:
        """``count`` tokens of it went out now."""
        if count <= 0:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = now
        else:
            self._after_first += count
        self._last = now

    def close(self, failed: bool = False, scored: bool = True) -> None:
        """It ended (``failed``: a miss; not ``scored``: its client left). Idempotent."""
        if self._mode is None or self._ticket is None or self._slo is None:
            return
        met: bool | None = None
        if failed:
            met = False
        elif scored and self._first is not None:
            gap = (self._last - self._first) / self._after_first if self._after_first else 0.0
            met = self._first - self._started <= self._slo.ttft_s and gap <= self._slo.itl_s
        self._mode.ended(self._ticket, met)


async def retry_pause(attempt: int, deadline: float) -> None:
    """The back-off before retry ``attempt`` (1, 2, ...), never past ``deadline``."""
    delay = min(RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** (attempt - 1))
    delay *= random.uniform(0.8, 1.2)
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
