"""`EngineAdminBackend`: KVAdmin's answers for a daemon, read from its engine and ledger.

Engine state is read on the engine thread (`EngineThread.call`), between two steps, so an
answer never sees a half-applied step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtransfer.connector.kv_groups import num_listed_blocks
from kvtransfer.connector.serving import KVTransferTotals
from kvtransfer.control.admin import EngineStatus, PeerInfo, TransferDirection, TransferInfo
from kvtransfer.control.placement import Placement
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.serve.engine_thread import EngineThread
from kvtransfer.serve.ledger import HeldKV, ServingLedger


def connector_totals(core: EngineCore) -> KVTransferTotals | None:
    """The connector's cumulative transfer counters (``None`` when it keeps none)."""
    return None if core.connector is None else core.connector.get_transfer_totals()


def transfer_counters(totals: KVTransferTotals) -> dict[str, int]:
    """The status counters a connector's totals replace.

    Blocks are counted once per request on the scheduler side (what the consumer read, as it
    reported to the producer); bytes are what crossed the wire, summed over workers (every
    layer, drafter included). So after transfers prefill's kv_blocks_sent equals decode's
    kv_blocks_received, and kv_bytes_sent >= kv_bytes_received (equal unless pulls were
    cancelled or refused after the producer sent them). A storage tier's writes are
    kv_blocks_saved, its loads count as received.
    """
    return {
        "kv_blocks_sent": totals.blocks_sent,
        "kv_bytes_sent": totals.bytes_sent,
        "kv_blocks_received": totals.blocks_received,
        "kv_bytes_received": totals.bytes_received,
        "kv_bytes_received_one_sided": totals.bytes_received_one_sided,
        "kv_bytes_received_pushed": totals.bytes_received_pushed,
        "kv_blocks_saved": totals.blocks_saved,
        "kv_bytes_saved": totals.bytes_saved,
        "kv_loads_failed": totals.loads_failed,
        "kv_leases_expired": totals.leases_expired,
        "handshakes": totals.handshakes,
        # Named by what UCX picked for one-sided operations (issue 36), counted by workers.
        **totals.protocols,
    }


def held_kv(engine: EngineThread, ledger: ServingLedger) -> list[HeldKV]:
    """The prefill requests whose blocks are still lent to the connector (forgets the rest)."""
    held = ledger.held()
    released = engine.call(
        lambda core: {
            h.request_id for h in held if not core.scheduler.is_lending_blocks(h.request_id)
        }
    )
    ledger.forget_held(released)
    return [h for h in held if h.request_id not in released]


class EngineAdminBackend:
    def __init__(
        self,
        *,
        engine: EngineThread,
        ledger: ServingLedger,
        role: str,
        engine_id: str,
        model: str,
        bytes_per_block: int,
        begin_drain: Callable[[], int],
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._identity = (role, engine_id, model)
        self._bytes_per_block = bytes_per_block
        self._begin_drain = begin_drain
        self._started = time.monotonic()
        # Read once: the affinity is the one the daemon was started with (taskset, cgroups).
        self._placement = Placement.of_this_process()

    def status(self) -> EngineStatus:
        role, engine_id, model = self._identity

        def read(
            core: EngineCore,
        ) -> tuple[int, int, KVTransferTotals | None, tuple[int, int], tuple[int, int]]:
            scheduler = core.scheduler
            blocks = scheduler.block_manager
            split = (core.config.tensor_parallel_size, core.config.pipeline_parallel_size)
            requests = (scheduler.num_running_requests, scheduler.num_waiting_requests)
            totals = connector_totals(core)
            return blocks.num_free_blocks, blocks.num_used_blocks, totals, split, requests

        free, used, totals, (tp, pp), (running, waiting) = self._engine.call(read)
        counters = self._ledger.counters()
        # The connector's own counts win where it keeps them (bytes that really crossed).
        if totals is not None:
            counters.update(transfer_counters(totals))
        return EngineStatus(
            role=role,
            engine_id=engine_id,
            model=model,
            tp_size=tp,
            pp_size=pp,
            num_free_blocks=free,
            num_used_blocks=used,
            uptime_s=time.monotonic() - self._started,
            counters=counters,
            num_running_requests=running,
            num_waiting_requests=waiting,
            host_id=self._placement.host_id,
            cpus=tuple(sorted(self._placement.cpus)),
        )

    def peers(self) -> list[PeerInfo]:
        return self._ledger.peers()

    def transfers(self) -> list[TransferInfo]:
        held = held_kv(self._engine, self._ledger)
        loading = self._engine.call(
            lambda core: [
                (r.request_id, dict(r.kv_transfer_params or {}), r.kv_load and r.kv_load.started_at)
                for r in core.scheduler.requests_loading_remote_kvs()
            ]
        )
        now = time.monotonic()
        transfers = [
            TransferInfo(
                request_id=held.request_id,
                peer_engine_id="",  # any consumer may pull it; none is known until it does
                direction=TransferDirection.SEND,
                num_blocks=held.num_blocks,
                num_bytes=held.num_bytes,
                age_s=now - held.since,
            )
            for held in held
        ]
        for request_id, params, started in loading:
            num_blocks = num_listed_blocks(params.get("remote_block_ids"))
            transfers.append(
                TransferInfo(
                    request_id=request_id,
                    peer_engine_id=str(params.get("remote_engine_id", "")),
                    direction=TransferDirection.RECV,
                    num_blocks=num_blocks,
                    num_bytes=num_blocks * self._bytes_per_block,
                    age_s=now - started if started is not None else 0.0,
                )
            )
        return transfers

    def abort(self, request_id: str) -> bool:
        return self._engine.abort(request_id)

    def drain(self) -> int:
        return self._begin_drain()
