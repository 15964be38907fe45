"""Instances leased for one choice: `Lease` (counted in the instance's ``in_flight`` until it
ends) and `Leases`, which picks them through the fleet and picks another after a failure that
sent nothing, within ``max_retries``."""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.router.daemon_flow.exchange import Exchange
from kvtransfer.router.daemon_flow.upstream import Upstream
from kvtransfer.router.errors import NoHealthyDaemon, UpstreamError
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.flow_rules import retry_pause
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.timeline import BOOK, now_ns


class Lease:
    """An instance picked for one leg, counted in its ``in_flight`` until `end` (idempotent)."""

    def __init__(self, upstream: Upstream, instance: Instance) -> None:
        self._upstream = upstream
        self.instance = instance
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._upstream.fleet.release(self.instance)


class Leases:
    """Picks the instances of a choice's legs (`take`), and another one for a leg that failed
    having sent nothing (`retry`)."""

    def __init__(self, max_retries: int, metrics: RouterMetrics) -> None:
        self._max_retries = max_retries
        self.metrics = metrics

    def take(
        self,
        upstream: Upstream,
        role: str,
        exchange: Exchange,
        tried: Sequence[Instance] = (),
        aggregated: bool | None = None,
    ) -> Lease:
        fleet = upstream.fleet
        started = now_ns()
        instance = fleet.pick(role, exchange.context, exclude=tried, aggregated=aggregated)
        BOOK.record(exchange.request_id, "pick", started, now_ns(), role=role)
        return Lease(upstream, instance)

    async def retry(
        self,
        upstream: Upstream,
        exchange: Exchange,
        tried: list[Instance],
        exc: UpstreamError,
        aggregated: bool | None = None,
    ) -> Lease:
        """Another instance of ``exc``'s role for a phase that failed having sent nothing, after
        a back-off; raises ``exc`` when it is not retryable, the retries are spent, or no
        untried instance is available. A decode that takes over KV from a prefill must not
        be an aggregated instance (``aggregated`` False)."""
        attempt = len(tried)
        if not exc.retryable or attempt > self._max_retries:
            raise exc
        await retry_pause(attempt, exchange.deadline)
        try:
            lease = self.take(upstream, exc.role, exchange, tried, aggregated)
        except NoHealthyDaemon:
            raise exc from None
        exchange.log.warning(
            "%s; retry %d on %s daemon %s", exc, attempt, exc.role, lease.instance.address
        )
        self.metrics.upstream_error(exc.role, exc.reason)
        self.metrics.retry(exc.role, exc.reason)
        tried.append(lease.instance)
        return lease
