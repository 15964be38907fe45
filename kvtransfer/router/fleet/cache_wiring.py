"""`CacheIndexWiring`: the cache-aware policies' prefix indexes follow the fleet.

An instance that joins a role whose policy is ``cache_aware`` is added to that policy's index
(with the fleet's KV block size) and, when the router knows where instances publish KV events
(``kv_events_port``: the same port on every instance's host, as a Kubernetes Deployment or a
compose service gives it), subscribed to; an instance that leaves is unsubscribed and
forgotten. Without events the index learns from the router's own picks (approximate); with
them it is precise while they flow and falls back per instance when they stop
(`kvtransfer.router.routing.prefix_index`). An instance taken out of the pool by a failed call (its
health) or by its circuit breaker fails the requests it was running: the blocks they made
pending there stop counting at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.breaker import OPEN
from kvtransfer.router.fleet.listener import FleetListener
from kvtransfer.router.routing.cache_policy import CacheAwarePolicy
from kvtransfer.router.routing.kv_events import EventSource, KVEventSubscribers
from kvtransfer.router.routing.policy import Policy
from kvtransfer.router.routing.prefix_index import PrefixIndex

logger = logging.getLogger("kvtransfer.router.cache_wiring")


def event_source(address: str, config: RouterConfig) -> EventSource | None:
    """Where the instance at gRPC ``address`` publishes, by the config's ports (None: no
    events configured)."""
    if config.kv_events_port is None:
        return None
    host = address.rpartition(":")[0]
    replay = config.kv_events_replay_port
    return EventSource(
        address,
        f"tcp://{host}:{config.kv_events_port}",
        replay_endpoint=None if replay is None else f"tcp://{host}:{replay}",
    )


class CacheIndexWiring:
    """A `FleetListener` that keeps the indexes in step, then tells ``inner`` (the metrics).

    Built on the router's event loop (the subscribers' sockets belong to it)."""

    def __init__(
        self, policies: Mapping[str, Policy], config: RouterConfig, inner: FleetListener
    ) -> None:
        self._config = config
        self._inner = inner
        self._indexes: dict[str, PrefixIndex] = {
            role: policy.index
            for role, policy in policies.items()
            if isinstance(policy, CacheAwarePolicy)
        }
        self._subscribers: dict[str, KVEventSubscribers] = (
            {role: KVEventSubscribers(index) for role, index in self._indexes.items()}
            if config.kv_events_port is not None
            else {}
        )
        # Subscriptions change in order per address: a remove never overtakes its add.
        self._last: dict[str, asyncio.Task[None]] = {}

    def instance_health(
        self, role: str, address: str, healthy: bool, state: str, first: bool
    ) -> None:
        self._inner.instance_health(role, address, healthy, state, first)
        index = self._indexes.get(role)
        if index is not None and not healthy:
            index.picks_ended(address)

    def instance_breaker(self, role: str, address: str, state: str) -> None:
        self._inner.instance_breaker(role, address, state)
        index = self._indexes.get(role)
        if index is not None and state == OPEN:
            index.picks_ended(address)

    def instance_membership(self, role: str, address: str, source: str, change: str) -> None:
        self._inner.instance_membership(role, address, source, change)
        index = self._indexes.get(role)
        if index is None:
            return
        subscribers = self._subscribers.get(role)
        if change == "added":
            index.add_instance(address, block_size=self._config.kv_block_size)
            events = event_source(address, self._config)
            if subscribers is not None and events is not None:
                self._then(address, subscribers.add(events))
        else:
            if subscribers is not None:
                self._then(address, subscribers.remove(address))
            index.remove_instance(address)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Per instance of a cache-aware role: what its index holds and whether its events
        flow (read at each scrape)."""
        registry.register(_IndexCollector(self._indexes))

    async def close(self) -> None:
        pending = list(self._last.values())
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for subscribers in self._subscribers.values():
            await subscribers.close()

    def _then(self, address: str, change: object) -> None:
        before = self._last.get(address)

        async def run() -> None:
            if before is not None:
                with contextlib.suppress(Exception):
                    await before
            try:
                await change  # type: ignore[misc]
            except Exception:
                # A publisher that cannot be reached leaves this instance on its approximate
                # index; the router keeps serving.
                logger.exception("KV event subscription change for %s failed", address)

        self._last[address] = asyncio.get_running_loop().create_task(run())


class _IndexCollector:
    def __init__(self, indexes: Mapping[str, PrefixIndex]) -> None:
        self._indexes = indexes

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "address"]
        blocks = GaugeMetricFamily(
            "kvtransfer_router_index_blocks",
            "Prefix blocks the router's index holds for the instance, by source: events (what "
            "its KV events said it cached), routed (learned from this router's picks) or "
            "pending (blocks of picks its events have not shown yet, counted with the events' "
            "until they do, the pick ends or a few seconds pass)",
            labels=[*labels, "source"],
        )
        precise = GaugeMetricFamily(
            "kvtransfer_router_index_precise",
            "1 while the instance's choices are scored from its KV events, 0 while from the "
            "routed requests (no events, not in sync, or lagging)",
            labels=labels,
        )
        silence = GaugeMetricFamily(
            "kvtransfer_router_kv_events_seconds_since_message",
            "Seconds since the instance's last KV event message (batch or heartbeat)",
            labels=labels,
        )
        for role, index in self._indexes.items():
            for stats in index.stats():
                key = [role, stats.address]
                blocks.add_metric([*key, "events"], stats.precise_blocks)
                blocks.add_metric([*key, "routed"], stats.approx_blocks)
                blocks.add_metric([*key, "pending"], stats.pending_blocks)
                precise.add_metric(key, 1.0 if stats.mode == "precise" else 0.0)
                if stats.seconds_since_message is not None:
                    silence.add_metric(key, stats.seconds_since_message)
        yield from (blocks, precise, silence)
