"""What both P/D flows (kvtransfer daemons over gRPC, vLLM servers over HTTP) decide alike:
whether a request is disaggregated or runs on a decode alone (`RouteDecider`: the fleet's view
and the arrival rate handed to `routing.disagg.decide`), when a P/D request is sent on to the
prefills (`RouteDecider.prefill_turn`, with SLO targets: `routing.prefill_order`) and how long
to wait before a retry on another instance (`retry_pause`)."""

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
from kvtransfer.router.fleet.service import ArrivalRate
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.routing.disagg import DisaggRule, RouteDecision, decide, prefill_s
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


class RouteDecider:
    """One flow's route decisions: its rule (from the config), the arrival rate it saw and,
    with SLO targets, the order of its P/D requests at busy prefills."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.rule = DisaggRule.of(config)
        self.arrivals = ArrivalRate()
        self.metrics = metrics
        self.order = None
        if self.rule.slo is not None:
            self.order = PrefillOrder(self.rule.slo.ttft_s, metrics.prefill_order_state)

    def decide(self, fleet: Fleet, route: RouteContext, max_tokens: int) -> RouteDecision:
        """P/D or a decode alone for one request, from the fleet's pickable instances now."""
        self.arrivals.arrived()
        pickable = [i for i in fleet.instances() if i.pickable()]
        decision = decide(
            self.rule,
            route,
            max_tokens,
            [i for i in pickable if i.role == "prefill"],
            [i for i in pickable if i.role == "decode" and not i.aggregated],
            fleet.policies["decode"],
            self.arrivals.per_s,
            self.order,
        )
        if decision.predicted:
            logger.debug("%s: %s", route.request_id, decision.describe())
        return decision

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


async def retry_pause(attempt: int, deadline: float) -> None:
    """The back-off before retry ``attempt`` (1, 2, ...), never past ``deadline``."""
    delay = min(RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** (attempt - 1))
    delay *= random.uniform(0.8, 1.2)
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
