"""What both P/D flows (kvtransfer daemons over gRPC, vLLM servers over HTTP) decide alike:
whether a prompt skips the prefill (conditional disaggregation, `goes_alone`) and how long to
wait before a retry on another instance (`retry_pause`)."""

from __future__ import annotations

import asyncio
import random
import time

from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.routing.policy import RouteContext, UncachedEstimator, whole_prompt_uncached

# Back-off before retry n: RETRY_BACKOFF_S * 2**(n-1), at most RETRY_MAX_BACKOFF_S, +-20%.
RETRY_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0


def goes_alone(fleet: Fleet, threshold: int, route: RouteContext) -> bool:
    """Conditional disaggregation: a known prompt with fewer uncached tokens than
    ``threshold`` (``disagg_min_prompt_tokens``; 0: never) is not worth a prefill and a KV
    transfer."""
    if threshold <= 0 or route.token_ids is None:
        return False
    candidates = [i for i in fleet.instances("decode") if i.pickable()]
    policy = fleet.policies["decode"]
    if isinstance(policy, UncachedEstimator):
        uncached = policy.uncached_tokens(candidates, route)
    else:
        uncached = whole_prompt_uncached(candidates, route)
    return uncached < threshold


async def retry_pause(attempt: int, deadline: float) -> None:
    """The back-off before retry ``attempt`` (1, 2, ...), never past ``deadline``."""
    delay = min(RETRY_MAX_BACKOFF_S, RETRY_BACKOFF_S * 2 ** (attempt - 1))
    delay *= random.uniform(0.8, 1.2)
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
