"""The router's Prometheus metrics, on a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvtransfer_router_requests",
            "Completions by HTTP status",
            ["status"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "kvtransfer_router_request_seconds",
            "Whole request",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            "kvtransfer_router_time_to_first_token_seconds",
            "Request in to first decode token",
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._upstream_errors = Counter(
            "kvtransfer_router_upstream_errors",
            "Daemon failures by role and HTTP status",
            ["role", "status"],
            registry=self.registry,
        )

    def finished(self, status: int, started: float | None, first_token_at: float | None) -> None:
        self._requests.labels(status=str(status)).inc()
        if started is not None:
            self._latency.observe(time.monotonic() - started)
            if first_token_at is not None:
                self._ttft.observe(first_token_at - started)

    def upstream_error(self, role: str, status: int) -> None:
        self._upstream_errors.labels(role=role, status=str(status)).inc()
