"""What a host that serves an engine (the daemons) reads from its scheduler-role connector.

Two optional capabilities, declared as hooks on `KVConnectorBase_V1` so a host never has to
guess at a connector's internals:

* `KVControlEndpoint` (`get_control_endpoint`): the handshake payloads the connector publishes,
  for the host to serve on its own port too, and the address the connector serves them on;
* `KVTransferTotals` (`get_transfer_totals`): cumulative transfer counters since start-up.

The connector layer sits below the control plane, so the payload source is typed here as the
`HandshakeSource` protocol; `kvtransfer.control.HandshakeBook` is the implementation the
first-party connectors hand out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from kvtransfer.connector.metadata import PpTpRank
from kvtransfer.v1 import handshake_pb2


class HandshakeSource(Protocol):
    """The payloads one engine answers ``KVHandshake.GetHandshake`` with."""

    @property
    def engine_id(self) -> str: ...

    @property
    def compat_hash(self) -> str: ...

    def payloads(
        self, ranks: Sequence[PpTpRank] | None = None
    ) -> list[handshake_pb2.HandshakePayload]:
        """Payloads of ``ranks`` (every worker when ``None``), sorted by rank; raises
        `kvtransfer.control.errors.HandshakeNotFoundError` for a rank the engine lacks."""
        ...


@dataclass(frozen=True)
class KVControlEndpoint:
    """A connector's control plane: ``book`` is what a host may serve as ``KVHandshake`` on its
    own port (the same payloads, generation and engine id); ``address`` is ``host:port`` where
    the connector itself serves them (with whatever else it serves there, e.g. release
    notices)."""

    book: HandshakeSource
    address: str


# Counters named so carry a protocol UCX picked (`KVTransferTotals.protocols`).
PROTOCOL_PREFIX = "ucx_protocol:"


@dataclass(frozen=True)
class KVTransferTotals:
    """Cumulative transfer counters of one engine since its connector started.

    Blocks are counted once per request whatever the TP x PP (what the scheduler half knows);
    bytes are what crossed the wire or the disk, summed over workers (every layer, drafter
    included). Totals of several connectors add field by field (``+``), so a combined
    connector reports the sum of its children.
    """

    # KV of this engine that consumers reported read (blocks), and the bytes served to them.
    blocks_sent: int = 0
    bytes_sent: int = 0
    # KV loaded into this engine from elsewhere (a producer or a store).
    blocks_received: int = 0
    bytes_received: int = 0
    # Of bytes_received, those read one-sided (RMA mode: the producer ran nothing per read).
    bytes_received_one_sided: int = 0
    # Of bytes_received one-sided, those the producer wrote (push data plane).
    bytes_received_pushed: int = 0
    # KV written to a store for later loads (a storage tier), not yet read by anyone.
    blocks_saved: int = 0
    bytes_saved: int = 0
    # Requests whose load failed (once per request).
    loads_failed: int = 0
    # Held KV freed because nobody pulled it in time.
    leases_expired: int = 0
    # Handshakes made with remote engines, and the time they took in all.
    handshakes: int = 0
    handshake_s: float = 0.0
    # What UCX said it picked for one-sided operations ("ucx_protocol:get cuda: <its words>")
    # -> how many workers reported it: shown with the admin status' counters.
    protocols: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: KVTransferTotals) -> KVTransferTotals:
        if not isinstance(other, KVTransferTotals):
            return NotImplemented
        numbers = [f.name for f in fields(self) if f.name != "protocols"]
        summed = {name: getattr(self, name) + getattr(other, name) for name in numbers}
        protocols = dict(self.protocols)
        for name, count in other.protocols.items():
            protocols[name] = protocols.get(name, 0) + count
        return KVTransferTotals(**summed, protocols=protocols)

    @classmethod
    def sum(cls, totals: Sequence[KVTransferTotals | None]) -> KVTransferTotals | None:
        """The field-wise sum of the totals given; ``None`` when none is (no child keeps any)."""
        kept = [t for t in totals if t is not None]
        if not kept:
            return None
        result = kept[0]
        for t in kept[1:]:
            result = result + t
        return result
