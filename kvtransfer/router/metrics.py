"""The router's Prometheus metrics, on a registry of its own.

A registry per app (not prometheus_client's global one) lets several routers live in one
process, as tests run them, without "duplicated timeseries" errors. Per-instance series
(``kvtransfer_router_instance_*``) are read from the fleet at each scrape (`InstanceView`), so
an instance that leaves the fleet leaves them too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtransfer.router.routing.policy import InstanceLoad
from kvtransfer.timeline import Span

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# Timeline spans run from tens of microseconds (a pick, a layer) to seconds (a cold handshake).
_SPAN_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    10,
)

# Not an HTTP status anyone sees: the client went away first (nginx's convention).
CLIENT_CLOSED = 499


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvtransfer_router_requests",
            "Completion requests by HTTP status (499: the client disconnected)",
            ["status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvtransfer_router_request_seconds",
            "Completion requests: HTTP request in to response done",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            "kvtransfer_router_time_to_first_token_seconds",
            "HTTP request in to the first decode token",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._spans = Histogram(
            "kvtransfer_router_span_seconds",
            "Each span of P/D requests' timelines (the kvtransfer.timeline field of an answer): "
            "router.* measured here, prefill.* and decode.* by those daemons",
            ["span"],
            buckets=_SPAN_BUCKETS,
            registry=self.registry,
        )
        self._phases = Histogram(
            "kvtransfer_router_phase_seconds",
            "Where P/D requests' time went, as the daemons measured it: prefill_queue, "
            "prefill_compute, kv_transfer (decode waiting for KV), kv_overlapped (of it, hidden "
            "behind the prefill's compute), decode_queue, decode_first_step; and second_token "
            "(first to second token, as streamed by this router)",
            ["phase"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._upstream_errors = Counter(
            "kvtransfer_router_upstream_errors",
            "Daemon failures by role (prefill, decode) and reason (gRPC code or outcome)",
            ["role", "reason"],
            registry=self.registry,
        )

        self._daemon_healthy = Gauge(
            "kvtransfer_router_daemon_healthy",
            "1 while the router picks this daemon (SERVING, no failed call since), else 0",
            ["role", "address"],
            registry=self.registry,
        )
        self._ejections = Counter(
            "kvtransfer_router_daemon_ejections",
            "Daemons taken out of the pool, by the state that ejected them",
            ["role", "address", "state"],
            registry=self.registry,
        )
        self._readmissions = Counter(
            "kvtransfer_router_daemon_readmissions",
            "Ejected daemons put back by a health check that found them SERVING",
            ["role", "address"],
            registry=self.registry,
        )
        self._retries = Counter(
            "kvtransfer_router_retries",
            "Phases retried on another instance after a failure that sent nothing, by role and "
            "the failure's reason",
            ["role", "reason"],
            registry=self.registry,
        )
        self._routes = Counter(
            "kvtransfer_router_routes",
            "Choices by route: disaggregated (prefill then decode), decode_only (on a decode "
            "alone: a short uncached prompt, or the SLO rule's choice), prefill_only (on a "
            "prefill alone, the SLO rule's choice) or aggregated (on an --aggregated instance)",
            ["mode"],
            registry=self.registry,
        )
        self._decisions = Counter(
            "kvtransfer_router_route_decisions",
            "Route decisions (kvtransfer.router.routing.disagg): disaggregated, decode_only or "
            "prefill_only, by reason (a threshold, the SLO predictions, or why neither applied)",
            ["mode", "reason"],
            registry=self.registry,
        )
        self._fleet_changes = Counter(
            "kvtransfer_router_fleet_changes",
            "Instances added to or removed from the fleet, by role, change and source (static, "
            "admin, dns:NAME:PORT)",
            ["role", "change", "source"],
            registry=self.registry,
        )
        self._breaker_transitions = Counter(
            "kvtransfer_router_breaker_transitions",
            "Circuit breaker state changes per instance, by the state entered",
            ["role", "address", "state"],
            registry=self.registry,
        )
        self.requests_running = Gauge(
            "kvtransfer_router_requests_running",
            "Completion requests admitted and not finished",
            registry=self.registry,
        )
        self.requests_queued = Gauge(
            "kvtransfer_router_requests_queued",
            "Completion requests waiting for admission (--max-concurrent-requests)",
            registry=self.registry,
        )
        self._cached_tokens = Counter(
            "kvtransfer_router_cached_tokens",
            "Prompt tokens served from a prefix cache, by role (the one that computed the "
            "prompt) and source: predicted by its cache-aware policy at the pick, or reported "
            "by the engine (usage.prompt_tokens_details.cached_tokens)",
            ["role", "source"],
            registry=self.registry,
        )
        self._predictions = Counter(
            "kvtransfer_router_cache_predictions",
            "Choices whose cached-token prediction was exact, over (the router expected more "
            "cached than the engine found: a route on a stale index) or under",
            ["role", "outcome"],
            registry=self.registry,
        )
        self._releases = Counter(
            "kvtransfer_router_kv_releases",
            "ReleaseKV calls to prefill daemons, by trigger (decode_failed, client_gone, error) "
            "and outcome (released, not_held, or the gRPC code)",
            ["trigger", "outcome"],
            registry=self.registry,
        )
        self._prefill_order = Histogram(
            "kvtransfer_router_prefill_wait_seconds",
            "With SLO targets, how long P/D requests waited in the router for a turn at the "
            "prefills (kvtransfer.router.routing.prefill_order), by how they were sent on: "
            "at_once, in_time (could still meet the TTFT target), late, or timed_out (failed "
            "before any prefill call: the request's time ran out)",
            ["order"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._prefill_turns = Gauge(
            "kvtransfer_router_prefill_turns",
            "With SLO targets, P/D requests sent on to the prefills and not done, and those "
            "the router holds back until a turn frees (state: sent, waiting)",
            ["state"],
            registry=self.registry,
        )
        self._fleet_mode_switches = Counter(
            "kvtransfer_router_fleet_mode_switches",
            "With SLO targets, switches of the whole fleet between P/D (pd) and aggregated "
            "operation (every request alone on the least loaded instance), by the mode entered "
            "(kvtransfer.router.routing.fleet_mode)",
            ["mode"],
            registry=self.registry,
        )
        self._fleet_duels = Counter(
            "kvtransfer_router_fleet_duels",
            "With SLO targets, duels between P/D and aggregated operation run to the end, by "
            "the winner (kvtransfer.router.routing.fleet_mode)",
            ["winner"],
            registry=self.registry,
        )
        self._fleet_aggregated = Gauge(
            "kvtransfer_router_fleet_aggregated",
            "1 while the fleet runs aggregated (with SLO targets, routing.fleet_mode), else 0",
            registry=self.registry,
        )

    def fleet_mode_switch(self, mode: str, why: str) -> None:
        """With SLO targets, the fleet switched to ``mode`` (`routing.fleet_mode`; ``why`` is
        logged there)."""
        self._fleet_mode_switches.labels(mode=mode).inc()
        self._fleet_aggregated.set(1 if mode == "aggregated" else 0)

    def fleet_duel(self, winner: str) -> None:
        self._fleet_duels.labels(winner=winner).inc()

    def prefill_order(self, order: str, waited_s: float) -> None:
        self._prefill_order.labels(order=order).observe(waited_s)

    def prefill_order_state(self, sent: int, waiting: int) -> None:
        self._prefill_turns.labels(state="sent").set(sent)
        self._prefill_turns.labels(state="waiting").set(waiting)

    def cache_prediction(self, role: str, predicted: int, reported: int) -> None:
        """A choice ended: the cached prompt tokens its ``role``'s policy predicted at the pick
        against those the engine that computed the prompt reported."""
        self._cached_tokens.labels(role=role, source="predicted").inc(predicted)
        self._cached_tokens.labels(role=role, source="reported").inc(reported)
        outcome = "exact" if predicted == reported else "over" if predicted > reported else "under"
        self._predictions.labels(role=role, outcome=outcome).inc()

    def request_done(self, status: int, seconds: float) -> None:
        self._requests.labels(status=str(status)).inc()
        self._latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def spans(self, spans: Iterable[Span]) -> None:
        """Every span of a choice's timeline, by qualified name (per-layer spans of one kind
        share a series: a layer's index is not a label)."""
        for span in spans:
            self._spans.labels(span=span.qualified_name()).observe(span.duration_s)

    def phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._phases.labels(phase=phase.removesuffix("_s")).observe(seconds)

    def upstream_error(self, role: str, reason: str) -> None:
        self._upstream_errors.labels(role=role, reason=reason).inc()

    def instance_health(
        self, role: str, address: str, healthy: bool, state: str, first: bool
    ) -> None:
        """An instance's health became known (``first``) or flipped."""
        self._daemon_healthy.labels(role=role, address=address).set(1 if healthy else 0)
        if first:
            return
        if healthy:
            self._readmissions.labels(role=role, address=address).inc()
        else:
            self._ejections.labels(role=role, address=address, state=state).inc()

    def kv_release(self, trigger: str, outcome: str) -> None:
        self._releases.labels(trigger=trigger, outcome=outcome).inc()

    def retry(self, role: str, reason: str) -> None:
        self._retries.labels(role=role, reason=reason).inc()

    def route_mode(self, mode: str) -> None:
        self._routes.labels(mode=mode).inc()

    def route_decision(self, mode: str, reason: str) -> None:
        self._decisions.labels(mode=mode, reason=reason).inc()

    def instance_breaker(self, role: str, address: str, state: str) -> None:
        self._breaker_transitions.labels(role=role, address=address, state=state).inc()

    def instance_membership(self, role: str, address: str, source: str, change: str) -> None:
        """An instance joined or left the fleet; a removed one's health series goes too."""
        self._fleet_changes.labels(role=role, change=change, source=source).inc()
        if change == "removed":
            # KeyError: removed before its first check.
            with contextlib.suppress(KeyError):
                self._daemon_healthy.remove(role, address)

    def watch_instances(self, instances: Callable[[], Iterable[InstanceView]]) -> None:
        """Serve the per-instance series of ``instances()`` (called at each scrape)."""
        self.registry.register(_InstanceCollector(instances))


class InstanceView(Protocol):
    """What the per-instance series read of an instance (`fleet.Instance`)."""

    role: str
    address: str
    in_flight: int
    picks: int
    load: InstanceLoad | None

    @property
    def breaker_state(self) -> str: ...


BREAKER_STATES = ("closed", "open", "half_open")


class _InstanceCollector:
    def __init__(self, instances: Callable[[], Iterable[InstanceView]]) -> None:
        self._instances = instances

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "address"]
        picks = CounterMetricFamily(
            "kvtransfer_router_instance_picks",
            "Times the role's policy picked this instance (retries included)",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "kvtransfer_router_instance_in_flight",
            "Requests this router routed to the instance that have not finished",
            labels=labels,
        )
        requests = GaugeMetricFamily(
            "kvtransfer_router_instance_requests",
            "The instance's own report of its requests (KVAdmin GetStatus), by state: running, "
            "waiting",
            labels=[*labels, "state"],
        )
        blocks = GaugeMetricFamily(
            "kvtransfer_router_instance_kv_blocks",
            "The instance's own report of its KV blocks, by kind: used, total",
            labels=[*labels, "kind"],
        )
        breaker = GaugeMetricFamily(
            "kvtransfer_router_instance_breaker_state",
            "1 for the instance's circuit breaker state (closed, open, half_open), else 0",
            labels=[*labels, "state"],
        )
        for instance in self._instances():
            names = [instance.role, instance.address]
            picks.add_metric(names, instance.picks)
            in_flight.add_metric(names, instance.in_flight)
            load = instance.load
            if load is not None:
                requests.add_metric([*names, "running"], load.running)
                requests.add_metric([*names, "waiting"], load.waiting)
                blocks.add_metric([*names, "used"], load.kv_blocks_used)
                blocks.add_metric([*names, "total"], load.kv_blocks_total)
            state = instance.breaker_state
            for name in BREAKER_STATES:
                breaker.add_metric([*names, name], 1 if name == state else 0)
        yield from (picks, in_flight, requests, blocks, breaker)
