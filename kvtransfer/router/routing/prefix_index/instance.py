"""What the index keeps per instance (`IndexedInstance`): its slot and block-size group, its
precise, approximate and pending sets, the health of its events; a pick's claim on pending
blocks (`Pick`); and what `PrefixIndex.stats` reports of it (`InstanceIndexStats`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from kvtransfer.router.routing.prefix_index.masks import Group
from kvtransfer.serve.kv_events import EngineHash

Mode = Literal["precise", "approximate"]

COUNT_BITS = 32
COUNT_MASK = (1 << COUNT_BITS) - 1


@dataclass
class IndexedInstance:
    address: str
    slot: int
    group: Group
    approx_capacity: int
    # precise: engine hash -> key; key -> how many engine hashes map to it
    engine_keys: dict[EngineHash, int] = field(default_factory=dict)
    precise_refs: dict[int, int] = field(default_factory=dict)
    approx: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # pending: key -> (serial << COUNT_BITS) | live picks claiming it, the serial that of the
    # pick that made the key pending: a pick releases its claim only on the entry it counted
    # in, not on one made after its own was confirmed (stored) and the block dropped again.
    pending: dict[int, int] = field(default_factory=dict)
    picks: dict[str, Pick] = field(default_factory=dict)
    # event health
    events_attached: bool = False
    synced: bool = False
    unusable: str | None = None
    heartbeats: bool = False
    last_message_at: float | None = None
    expecting_since: float | None = None
    skipped_events: int = 0

    @property
    def bit(self) -> int:
        return 1 << self.slot


@dataclass(eq=False)
class Pick:
    """A request routed to ``address`` whose blocks its events have not all shown yet."""

    pick: str
    address: str
    expires: float
    serial: int
    fresh: list[int]  # the blocks it made pending (their entries have its serial)
    shared: list[int]  # the blocks another live pick had made pending, and those serials
    shared_serials: list[int]


@dataclass(frozen=True)
class InstanceIndexStats:
    address: str
    mode: Mode
    block_size: int
    precise_blocks: int
    approx_blocks: int
    pending_blocks: int
    pending_picks: int
    events_attached: bool
    synced: bool
    unusable: str | None
    seconds_since_message: float | None
    skipped_events: int
