"""The router's Prometheus metrics, on a registry of its own.

A registry per app (not prometheus_client's global one) lets several routers live in one
process, as tests run them, without "duplicated timeseries" errors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

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
        self._releases = Counter(
            "kvtransfer_router_kv_releases",
            "ReleaseKV calls to prefill daemons, by trigger (decode_failed, client_gone, error) "
            "and outcome (released, not_held, or the gRPC code)",
            ["trigger", "outcome"],
            registry=self.registry,
        )

    def request_done(self, status: int, seconds: float) -> None:
        self._requests.labels(status=str(status)).inc()
        self._latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._phases.labels(phase=phase.removesuffix("_s")).observe(seconds)

    def upstream_error(self, role: str, reason: str) -> None:
        self._upstream_errors.labels(role=role, reason=reason).inc()

    def daemon_health(
        self, role: str, address: str, healthy: bool, state: str, first: bool
    ) -> None:
        """A daemon's health became known (``first``) or flipped."""
        self._daemon_healthy.labels(role=role, address=address).set(1 if healthy else 0)
        if first:
            return
        if healthy:
            self._readmissions.labels(role=role, address=address).inc()
        else:
            self._ejections.labels(role=role, address=address, state=state).inc()

    def kv_release(self, trigger: str, outcome: str) -> None:
        self._releases.labels(trigger=trigger, outcome=outcome).inc()
