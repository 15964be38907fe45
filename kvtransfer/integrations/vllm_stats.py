"""Our connectors' transfer stats in vLLM's stats pipeline: its log line and ``/metrics``.

vLLM asks every worker's connector (and the scheduler's) for `get_kv_connector_stats` each
step, merges them with ``aggregate``, ships ``data`` to its logger process, rebuilds them there
with the connector class's ``build_kv_connector_stats`` and prints ``reduce()`` as "KV Transfer
metrics: ..." (with ``--disable-log-stats`` off), and feeds the same ``data`` to the
connector's Prometheus metrics (``build_prom_metrics``, ``observe``).

The data is our workers' `KVConnectorStats` data as they count it (see `UcxWorker.stats`):
numbers add across workers and steps, lists (``transfer_s``, ``handshake_ms``) concatenate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorStats as VllmConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtransfer.connector.metadata import KVConnectorStats
from kvtransfer.connector.watchdog import LOAD_HOOK, STEP_HOOK

# Our counters exported as Prometheus counters: data key -> (metric name, what it counts).
COUNTERS = {
    "num_loads": ("vllm:kvtransfer_loads", "KV loads completed by this engine's workers"),
    "num_loads_failed": ("vllm:kvtransfer_loads_failed", "KV loads that failed"),
    "num_loads_cancelled": ("vllm:kvtransfer_loads_cancelled", "KV loads of aborted requests"),
    "blocks_received": ("vllm:kvtransfer_blocks_received", "KV blocks loaded (per worker)"),
    "bytes_received": ("vllm:kvtransfer_bytes_received", "KV bytes loaded"),
    "bytes_received_sliding_window": (
        "vllm:kvtransfer_bytes_received_sliding_window",
        "Of the KV bytes loaded, those of sliding-window layers (their in-window tail)",
    ),
    "bytes_received_recurrent_state": (
        "vllm:kvtransfer_bytes_received_recurrent_state",
        "Of the KV bytes loaded, recurrent-state pages (Mamba / Gated DeltaNet layers)",
    ),
    "bytes_sent": ("vllm:kvtransfer_bytes_sent", "KV bytes consumers read from this engine"),
    "num_sends": ("vllm:kvtransfer_sends", "Held requests released after their consumer read"),
    "num_leases_expired": ("vllm:kvtransfer_leases_expired", "Held requests nobody read"),
    "num_handshakes": ("vllm:kvtransfer_handshakes", "Handshakes with producer engines"),
    "num_hook_stalls": (
        "vllm:kvtransfer_hook_stalls",
        "Connector hooks inside a step that ran past their bound (logged with their stack)",
    ),
    "ucx_idle_naps": (
        "vllm:kvtransfer_ucx_idle_naps",
        "Naps of our UCX loop after UCX woke it for nothing (a spin its pacing prevented)",
    ),
    "ucx_busy_naps": (
        "vllm:kvtransfer_ucx_busy_naps",
        "Naps of our UCX loop while UCX could not be armed (a spin its pacing prevented)",
    ),
    "num_step_stalls": (
        "vllm:kvtransfer_step_stalls",
        "Engine steps that ran past step_bound_s, in our hooks or not (logged with their stack)",
    ),
    "num_loads_overdue": (
        "vllm:kvtransfer_loads_overdue",
        "KV loads still running past their deadline (logged with their stack)",
    ),
}
# Buckets of the per-load transfer time (seconds).
PULL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass
class TransferStats(VllmConnectorStats):
    """vLLM's stats container over our data dict."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: VllmConnectorStats) -> TransferStats:
        merged = KVConnectorStats(data=dict(self.data)).aggregate(
            KVConnectorStats(data=dict(other.data))
        )
        return TransferStats(data=merged.data)

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's log line shows: the counters, and the transfer and handshake times."""
        reduced: dict[str, int | float] = {}
        for key, value in sorted(self.data.items()):
            if key == "transfer_s":
                reduced["loads_timed"] = len(value)
                if value:
                    reduced["load_ms_p50"] = round(statistics.median(value) * 1e3, 3)
                    reduced["load_ms_max"] = round(max(value) * 1e3, 3)
            elif key == "handshake_ms":
                if value:
                    reduced["handshake_ms_p50"] = round(statistics.median(value), 3)
            elif not isinstance(value, list):
                reduced[key] = value
        return reduced

    def is_empty(self) -> bool:
        return not self.data


def with_stalls(stats: KVConnectorStats | None, stalls: dict[str, int]) -> KVConnectorStats | None:
    """``stats`` plus the watchdog's stalls since the last step (loads counted apart)."""
    if not stalls:
        return stats
    data = dict(stats.data) if stats is not None else {}
    overdue, steps = stalls.get(LOAD_HOOK, 0), stalls.get(STEP_HOOK, 0)
    hooks = sum(stalls.values()) - overdue - steps
    for key, count in (
        ("num_hook_stalls", hooks),
        ("num_loads_overdue", overdue),
        ("num_step_stalls", steps),
    ):
        if count:
            data[key] = data.get(key, 0) + count
    return KVConnectorStats(data=data)


def vllm_stats(stats: KVConnectorStats | None) -> TransferStats | None:
    """Our connector's stats as vLLM's (None when there is nothing to report)."""
    if stats is None or stats.is_empty():
        return None
    return TransferStats(data=dict(stats.data))


class TransferPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtransfer_*`` counters and the per-load transfer time histogram."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=what, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, what) in COUNTERS.items()
        }
        self._load_seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvtransfer_load_seconds",
                documentation="Time each KV load took on a worker (handshake included)",
                buckets=list(PULL_BUCKETS),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counters in self._counters.items():
            value = transfer_stats_data.get(key)
            if value:
                counters[engine_idx].inc(value)
        for seconds in transfer_stats_data.get("transfer_s", ()):
            self._load_seconds[engine_idx].observe(seconds)
