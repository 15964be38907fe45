"""A fake engine start-up: workers publish handshake metadata, a PP-aware connector receives it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtransfer.connector.base import KVConnectorBase_V1
from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    PpTpRank,
    merge_handshake_metadata,
)
from kvtransfer.control import CompatibilityInfo, HandshakeBook

NUM_LAYERS = 8


class FakeWorkerMetadata(KVConnectorHandshakeMetadata):
    worker_address: str
    layer_start: int
    layer_end: int
    num_kv_heads: int
    base_addresses: tuple[int, ...]


class PublishingConnector(KVConnectorBase_V1):
    """Scheduler half of a PP-aware connector: publishes to its book, remembers what it got."""

    def __init__(self, config: KVTransferConfig, book: HandshakeBook) -> None:
        super().__init__(config, KVConnectorRole.SCHEDULER)
        self.book = book
        self.received: dict[PpTpRank, KVConnectorHandshakeMetadata] | None = None

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]
    ) -> None:
        self.received = dict(metadata)
        self.book.publish(metadata)


def make_compat(**overrides: Any) -> CompatibilityInfo:
    fields: dict[str, Any] = dict(
        model="test/tiny-model",
        dtype="float16",
        total_num_kv_heads=4,
        head_size=32,
        num_layers=NUM_LAYERS,
        block_size=16,
        wire_version=1,
    )
    return CompatibilityInfo(**{**fields, **overrides})


def worker_metadata(engine_id: str, pp_rank: int, tp_rank: int, pp_size: int, tp_size: int):
    per_stage = NUM_LAYERS // pp_size
    return FakeWorkerMetadata(
        worker_address=f"ucx://127.0.0.1/{engine_id}/{pp_rank}/{tp_rank}",
        layer_start=pp_rank * per_stage,
        layer_end=(pp_rank + 1) * per_stage,
        num_kv_heads=4 // tp_size,
        base_addresses=(0x7F00_0000_0000 + 0x1000 * (pp_rank * tp_size + tp_rank), 0x10),
    )


def start_engine(book: HandshakeBook, pp_size: int, tp_size: int) -> PublishingConnector:
    """What an engine does at start-up: every worker reports, the engine merges, the scheduler
    half of the connector receives the result."""
    config = KVTransferConfig(kv_connector="PublishingConnector", engine_id=book.engine_id)
    connector = PublishingConnector(config, book)
    per_worker = [
        {(pp, tp): worker_metadata(book.engine_id, pp, tp, pp_size, tp_size)}
        for pp in range(pp_size)
        for tp in range(tp_size)
    ]
    connector.set_xfer_handshake_metadata_pp_aware(merge_handshake_metadata(per_worker))
    return connector
