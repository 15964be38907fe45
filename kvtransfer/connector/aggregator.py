"""`KVOutputAggregator`: turn every worker's connector output into the engine's view.

A transfer is finished for the engine only when every worker that takes part in it has
reported it; workers report in different steps, so the aggregator keeps, per request and per
direction, the set of workers that reported so far. A step that failed on some workers may hand
the others' outputs to `defer` (vLLM 0.33's ``ft_defer_kv_connector_outputs``): they are counted
at the next `aggregate`, so what those workers reported is not lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.metadata import KVConnectorStats
from kvtransfer.connector.outputs import KVConnectorOutput


@dataclass
class _Pending:
    """Workers still owed a report for one request in one direction."""

    expected: int
    reported: set[int] = field(default_factory=set)
    failed: bool = False


class KVOutputAggregator:
    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count < 1:
            raise ValueError(f"expected_finished_count must be >= 1, got {expected_finished_count}")
        self._expected_finished_count = expected_finished_count
        self._sending: dict[str, _Pending] = {}
        self._recving: dict[str, _Pending] = {}
        # Reasons arrive with a worker's report and leave with the engine-wide failure.
        self._reasons: dict[str, str] = {}
        # Outputs of failed steps, each in worker order, counted at the next aggregate.
        self._deferred: list[tuple[KVConnectorOutput | None, ...]] = []

    @classmethod
    def from_connector(cls, connector: KVConnectorBase_V1, world_size: int) -> KVOutputAggregator:
        return cls(connector.get_finished_count() or world_size)

    @property
    def expected_finished_count(self) -> int:
        return self._expected_finished_count

    def num_pending(self) -> int:
        """Requests some but not all workers reported, and deferred outputs not counted yet
        (a leak check for tests)."""
        return len(self._sending) + len(self._recving) + len(self._deferred)

    def defer(self, outputs: Sequence[KVConnectorOutput | None]) -> None:
        """Keep the connector outputs of a step that failed on some workers (one per worker,
        in worker order, ``None`` for a failed one) for the next `aggregate`, which counts
        them before that step's own."""
        self._deferred.append(tuple(outputs))

    def aggregate(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """Merge one step's connector outputs (one per worker, in worker order, ``None`` for a
        worker that reported nothing) into what the engine acts on: the transfers every
        worker has now reported, or ``None`` when there is nothing to act on. Inputs are
        never mutated."""
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        failed_recving: set[str] = set()
        invalid_block_ids: set[int] = set()
        stats: KVConnectorStats | None = None

        deferred, self._deferred = self._deferred, []
        steps = [*deferred, tuple(outputs)]
        for worker, kv_out in ((w, o) for step in steps for w, o in enumerate(step)):
            if kv_out is None:
                continue
            if kv_out.expected_finished_count > 0:
                # Requests already being counted keep the count they started with.
                self._expected_finished_count = kv_out.expected_finished_count
            self._count(
                worker, kv_out.finished_sending or set(), set(), self._sending, finished_sending
            )
            failed = kv_out.failed_recving or set()
            # A failed receive is a finished receive even if the connector forgot to say so.
            self._count(
                worker,
                (kv_out.finished_recving or set()) | failed,
                failed,
                self._recving,
                finished_recving,
                failed_recving,
            )
            invalid_block_ids |= kv_out.invalid_block_ids or set()
            for req_id, reason in (kv_out.load_failure_reasons or {}).items():
                self._reasons.setdefault(req_id, reason)
            if kv_out.kv_connector_stats is not None and not kv_out.kv_connector_stats.is_empty():
                stats = (
                    kv_out.kv_connector_stats
                    if stats is None
                    else stats.aggregate(kv_out.kv_connector_stats)
                )

        reasons = {rid: self._reasons.pop(rid) for rid in finished_recving if rid in self._reasons}
        merged = KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            failed_recving=failed_recving or None,
            invalid_block_ids=invalid_block_ids or None,
            kv_connector_stats=stats,
            load_failure_reasons={r: reasons[r] for r in failed_recving if r in reasons} or None,
        )
        return None if merged.is_empty() else merged

    def _count(
        self,
        worker: int,
        req_ids: set[str],
        failed_ids: set[str],
        pending: dict[str, _Pending],
        finished: set[str],
        finished_failed: set[str] | None = None,
    ) -> None:
        for req_id in req_ids:
            entry = pending.get(req_id)
            if entry is None:
                entry = pending[req_id] = _Pending(self._expected_finished_count)
            # A set, not a counter: a worker repeating itself must not stand in for another.
            entry.reported.add(worker)
            entry.failed |= req_id in failed_ids
            if len(entry.reported) >= entry.expected:
                del pending[req_id]
                finished.add(req_id)
                if entry.failed and finished_failed is not None:
                    finished_failed.add(req_id)
