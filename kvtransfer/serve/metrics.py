"""`DaemonMetrics`: the Prometheus metrics of one daemon, on a registry of its own.

A private registry (not prometheus_client's global one) keeps two daemons in one process, as in
tests, from sharing counters.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BYTES_BUCKETS = tuple(float(4**i * 1024) for i in range(12))  # 1 KiB .. 4 GiB

# Every reason `failure` is called with, exported at 0 from start-up: a series that first
# appears at 1 is invisible to rate() and increase(), so the first recompute fallback (say)
# would raise no alert (deploy/prometheus/kvtransfer-rules.yaml).
FAILURE_REASONS = ("kv_load_failed", "kv_load_recomputed", "error", "rejected")


class DaemonMetrics:
    def __init__(self, role: str, engine_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "engine_id": engine_id}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            metric = Counter(name, doc, [*names, *extra], registry=self.registry)
            return metric if extra else metric.labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(name, doc, names, buckets=buckets, registry=self.registry)
            return metric.labels(**labels)

        self._labels = labels
        self._requests = counter(
            "kvtransfer_requests", "Requests by how they finished", ("finish_reason",)
        )
        self._failures = counter("kvtransfer_failures", "Failures by reason", ("reason",))
        for reason in FAILURE_REASONS:
            self._failures.labels(**labels, reason=reason)
        self._releases = counter(
            "kvtransfer_kv_releases",
            "ReleaseKV calls by outcome (released, not_held, invalid, denied, unavailable)",
            ("outcome",),
        )
        self.ttft = histogram(
            "kvtransfer_time_to_first_token_seconds", "Admission to first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "kvtransfer_inter_token_latency_seconds", "Between streamed tokens", _LATENCY_BUCKETS
        )
        self.kv_bytes = histogram(
            "kvtransfer_kv_transfer_bytes", "KV bytes received per request", _BYTES_BUCKETS
        )
        self.kv_seconds = histogram(
            "kvtransfer_kv_transfer_seconds",
            "Time a request waited for its remote KV",
            _LATENCY_BUCKETS,
        )
        self.queue_seconds = histogram(
            "kvtransfer_queue_seconds",
            "Queued until first computed, time waiting for remote KV excluded",
            _LATENCY_BUCKETS,
        )
        self.compute_seconds = histogram(
            "kvtransfer_first_compute_seconds",
            "First computed until the first token sampled here (prefill compute; a decode's "
            "first step)",
            _LATENCY_BUCKETS,
        )
        self.handshakes = counter("kvtransfer_handshakes", "Handshakes made by this engine")
        self.handshake_seconds = histogram(
            "kvtransfer_handshake_seconds", "Handshake latency", _LATENCY_BUCKETS
        )
        self._prompt_tokens = counter(
            "kvtransfer_prompt_tokens", "Prompt tokens of the requests that finished here"
        )
        self._prefix_hit_tokens = counter(
            "kvtransfer_prefix_cache_hit_tokens",
            "Of those prompt tokens, the ones this engine's prefix cache already held",
        )
        self._recomputed_tokens = counter(
            "kvtransfer_kv_recomputed_tokens",
            "Prompt tokens computed here because their KV load failed "
            "(kv_load_failure_policy recompute)",
        )
        self._leases_expired = counter(
            "kvtransfer_kv_leases_expired",
            "Held KV freed because no consumer pulled it within its lease (a producer's count)",
        )
        self._blocks_used = Gauge(
            "kvtransfer_kv_blocks_used", "KV blocks in use", names, registry=self.registry
        ).labels(**labels)
        self._blocks_free = Gauge(
            "kvtransfer_kv_blocks_free", "KV blocks free", names, registry=self.registry
        ).labels(**labels)
        self._server: Any = None
        self._lock = threading.Lock()

    def request_finished(self, finish_reason: str) -> None:
        self._requests.labels(**self._labels, finish_reason=finish_reason).inc()

    def failure(self, reason: str) -> None:
        self._failures.labels(**self._labels, reason=reason).inc()

    def prompt_finished(self, prompt_tokens: int, prefix_hit_tokens: int, recomputed: int) -> None:
        self._prompt_tokens.inc(prompt_tokens)
        self._prefix_hit_tokens.inc(prefix_hit_tokens)
        self._recomputed_tokens.inc(recomputed)

    def leases_expired(self, count: int) -> None:
        self._leases_expired.inc(count)

    def kv_release(self, outcome: str) -> None:
        self._releases.labels(**self._labels, outcome=outcome).inc()

    def set_blocks(self, used: int, free: int) -> None:
        self._blocks_used.set(used)
        self._blocks_free.set(free)

    def record_handshakes(self, count: int, total_ms: float) -> None:
        """``count`` handshakes took ``total_ms`` together (the connector reports sums)."""
        if count <= 0:
            return
        self.handshakes.inc(count)
        for _ in range(count):
            self.handshake_seconds.observe(total_ms / count / 1e3)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP; returns the bound port (``port`` 0: any free one)."""
        with self._lock:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
            self._server = server
            return int(server.server_port)

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
