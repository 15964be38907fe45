"""`HandshakeBook`: the handshake payloads one engine serves over `KVHandshake`.

The engine's scheduler-side connector receives every worker's metadata once at start-up (in
`set_xfer_handshake_metadata_pp_aware`) and hands it to ``book.publish``; the control server then
answers `GetHandshake` from the book. Payloads are encoded once, at publish time.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping, Sequence

from kvtransfer.connector.metadata import (
    KVConnectorHandshakeMetadata,
    PpTpRank,
    merge_handshake_metadata,
)
from kvtransfer.control.compat import CompatibilityInfo
from kvtransfer.control.errors import HandshakeNotFoundError
from kvtransfer.v1 import handshake_pb2


def new_generation() -> int:
    # 63 bits so it survives any signed-int64 store on the way (databases, JSON consumers).
    return secrets.randbits(63)


class HandshakeBook:
    """What one engine publishes. One book per engine start: a restarted engine builds a new
    book, gets a new ``generation``, and so never serves changed payloads under an old one.
    Thread-safe: the engine publishes from its own thread while the server reads on its loop.
    """

    def __init__(
        self,
        engine_id: str,
        compat: CompatibilityInfo,
        generation: int | None = None,
    ) -> None:
        if not engine_id.strip():
            raise ValueError("engine_id must not be blank")
        if generation is not None and not 0 <= generation < 2**64:
            raise ValueError(f"generation must fit in a uint64, got {generation}")
        self.engine_id = engine_id
        self.compat = compat
        self.compat_hash = compat.compat_hash()
        self.generation = new_generation() if generation is None else generation
        self._lock = threading.Lock()
        self._payloads: dict[PpTpRank, handshake_pb2.HandshakePayload] | None = None

    @property
    def is_published(self) -> bool:
        return self._payloads is not None

    def publish(self, metadata: Mapping[PpTpRank, KVConnectorHandshakeMetadata]) -> None:
        """Publish every worker's metadata, keyed by ``(pp_rank, tp_rank)``; once per book."""
        # Reuse the engine's merge so keys are validated exactly as the engine validates them.
        checked = merge_handshake_metadata([metadata])
        if not checked:
            raise ValueError(f"engine {self.engine_id!r}: no handshake metadata to publish")
        for rank, md in checked.items():
            if not isinstance(md, KVConnectorHandshakeMetadata):
                raise ValueError(
                    f"handshake metadata for {rank} must be a KVConnectorHandshakeMetadata, "
                    f"got {type(md).__name__}"
                )
        payloads = {rank: self._encode(rank, md) for rank, md in sorted(checked.items())}
        with self._lock:
            if self._payloads is not None:
                raise RuntimeError(
                    f"engine {self.engine_id!r} already published its handshake metadata; a "
                    "restarted engine needs a new HandshakeBook (and so a new generation)"
                )
            self._payloads = payloads

    def payload(self, pp_rank: int, tp_rank: int) -> handshake_pb2.HandshakePayload:
        payloads = self._published()
        try:
            return payloads[(pp_rank, tp_rank)]
        except KeyError:
            raise HandshakeNotFoundError(
                f"engine {self.engine_id!r} has no worker at (pp_rank, tp_rank)="
                f"({pp_rank}, {tp_rank}); it has {sorted(payloads)}"
            ) from None

    def payloads(
        self, ranks: Sequence[PpTpRank] | None = None
    ) -> list[handshake_pb2.HandshakePayload]:
        """Payloads of ``ranks`` (every worker when ``None``), sorted by rank."""
        if ranks is None:
            return list(self._published().values())
        return [self.payload(pp, tp) for pp, tp in sorted(set(ranks))]

    def _published(self) -> dict[PpTpRank, handshake_pb2.HandshakePayload]:
        payloads = self._payloads
        if payloads is None:
            raise HandshakeNotFoundError(
                f"engine {self.engine_id!r} has not published its handshake metadata yet"
            )
        return payloads

    def _encode(
        self, rank: PpTpRank, metadata: KVConnectorHandshakeMetadata
    ) -> handshake_pb2.HandshakePayload:
        pp_rank, tp_rank = rank
        return handshake_pb2.HandshakePayload(
            compat_hash=self.compat_hash,
            engine_id=self.engine_id,
            compat=self.compat.to_proto(),
            generation=self.generation,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            metadata=metadata.encode(),
        )
