"""Giving back KV nobody will decode (step 6 of a choice, `choice`): ``ReleaseKV`` on the
prefill daemon that holds it, in a task of its own that nobody waits for and cancellation does
not reach; a prefill abandoned while it runs gets `PREFILL_GRACE_S` to deliver a final message
already on its way, whose KV is then released the same way."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtransfer.router.daemon_flow.exchange import Exchange
from kvtransfer.router.daemon_flow.leases import Lease
from kvtransfer.router.daemon_flow.upstream import PrefillResult, Upstream
from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.metrics import RouterMetrics

# How long a prefill call whose client left may take to deliver a final message already sent.
PREFILL_GRACE_S = 0.5


class KvReleases:
    """The ``ReleaseKV`` calls and abandoned prefills in flight (``tasks``): they outlive their
    choices, not the channels."""

    def __init__(self, upstream: Upstream, timeout_s: float, metrics: RouterMetrics) -> None:
        self.upstream: Upstream | None = upstream
        self._timeout_s = timeout_s
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()

    async def drain(self) -> None:
        """Wait for the releases in flight (each has a deadline)."""
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def stop(self) -> None:
        """No more releases: the channels are closing (a lease frees the KV instead)."""
        self.upstream = None

    def abandon(
        self,
        exchange: Exchange,
        lease: Lease,
        call: asyncio.Future[PrefillResult],
        trigger: str,
    ) -> None:
        """Nobody waits for this prefill any more: give it the grace, release what it
        returns, cancel it past the grace."""
        if call.done():
            if not call.cancelled() and call.exception() is None:
                self.soon(exchange, call.result(), trigger)
            return
        self._spawn(lease.instance, self._release_late(exchange, call, trigger))

    async def _release_late(
        self, exchange: Exchange, call: asyncio.Future[PrefillResult], trigger: str
    ) -> None:
        try:
            prefill = await asyncio.wait_for(call, PREFILL_GRACE_S)
        except (TimeoutError, asyncio.CancelledError, UpstreamError):
            return  # cancelled while computing (the daemon releases), or failed: nothing held
        upstream = self.upstream
        if upstream is not None:
            await self._release(upstream, exchange, prefill, trigger)

    def unless_decoded(self, exchange: Exchange, prefill: PrefillResult, trigger: str) -> None:
        """Unless the decode stream finished cleanly, give the prefill's KV back now."""
        if not exchange.decoded:
            self.soon(exchange, prefill, trigger)

    def soon(self, exchange: Exchange, prefill: PrefillResult, trigger: str) -> None:
        """``ReleaseKV`` in a task of its own: nobody waits for it, and cancelling the choice
        (the client went away) does not cancel it."""
        upstream = self.upstream
        if upstream is None:  # closed: the lease frees the KV instead
            return
        self._spawn(prefill.daemon, self._release(upstream, exchange, prefill, trigger))

    def _spawn(self, instance: Instance, release: Any) -> None:
        upstream = self.upstream
        if upstream is None:
            raise RuntimeError("the router is closed (no gRPC channels)")
        # The instance's channel stays open for the call, even if it leaves the fleet now.
        upstream.fleet.call_started(instance)
        task = asyncio.get_running_loop().create_task(release)
        self.tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            upstream.fleet.call_ended(instance)

        task.add_done_callback(done)

    async def _release(
        self, upstream: Upstream, exchange: Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        outcome = await upstream.release_kv(prefill, exchange.request_id, self._timeout_s)
        self.metrics.kv_release(trigger, outcome)
        log = exchange.log.info if outcome in ("released", "not_held") else exchange.log.warning
        log("KV release on %s (%s): %s", prefill.daemon.address, trigger, outcome)
