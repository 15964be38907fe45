"""What both P/D flows (kvtransfer daemons over gRPC, vLLM servers over HTTP) decide alike:
whether a request is disaggregated or runs on a decode alone (`RouteDecider`: the fleet's view
and the arrival rate handed to `routing.disagg.decide`) and how long to wait before a retry on
another instance (`retry_pause`)."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.service import ArrivalRate
from kvtransfer.router.routing.disagg import DisaggRule, RouteDecision, decide
from kvtransfer.router.routing.policy import RouteContext

logger = logging.getLogger(__name__)

# Back-off before retry n: RETRY_BACKOFF_S * 2**(n-1), at most RETRY_MAX_BACKOFF_S, +-20%.
RETRY_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0


class RouteDecider:
    """One flow's route decisions: its rule (from the config) and the arrival rate it saw."""

    def __init__(self, config: RouterConfig) -> None:
        self.rule = DisaggRule.of(config)
        self.arrivals = ArrivalRate()

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
        )
        if decision.predicted:
            logger.debug("%s: %s", route.request_id, decision.describe())
        return decision


async def retry_pause(attempt: int, deadline: float) -> None:
    """The back-off before retry ``attempt`` (1, 2, ...), never past ``deadline``."""
    delay = min(RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** (attempt - 1))
    delay *= random.uniform(0.8, 1.2)
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
