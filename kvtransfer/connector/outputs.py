"""What a connector's worker half reports after a step (and, aggregated, the engine sees)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.connector.metadata import KVConnectorStats


@dataclass
class KVConnectorOutput:
    """One worker's (or, after aggregation, the engine's) connector results for one step.

    Id sets are ``None`` or non-empty. ``failed_recving`` ⊆ ``finished_recving``.
    ``expected_finished_count`` > 0 tells the aggregator how many workers must report requests
    created from now on (0 = keep the current count).
    """

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None
    invalid_block_ids: set[int] | None = None
    kv_connector_stats: KVConnectorStats | None = None
    # Why loads in failed_recving failed, by request id (not every failure has one).
    load_failure_reasons: dict[str, str] | None = None
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        return (
            not self.finished_sending
            and not self.finished_recving
            and not self.failed_recving
            and not self.invalid_block_ids
            and (self.kv_connector_stats is None or self.kv_connector_stats.is_empty())
            and self.expected_finished_count == 0
        )
