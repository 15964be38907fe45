"""`PrefixIndex`: which instance holds which prompt prefix in its KV cache (`index`), built from
the router's keys of prompt blocks (`keys`), kept as bit masks per key (`masks`), per instance
(`instance`) in three sets: precise from its KV events (`precise`), approximate from the picks,
and pending for picks its events do not show yet (`pending`)."""

from __future__ import annotations

from kvtransfer.router.routing.prefix_index.index import (
    DEFAULT_APPROX_CAPACITY_BLOCKS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_EVENT_LAG_S,
    DEFAULT_PENDING_TTL_S,
    PrefixIndex,
)
from kvtransfer.router.routing.prefix_index.instance import InstanceIndexStats, Mode
from kvtransfer.router.routing.prefix_index.keys import block_keys

__all__ = [
    "DEFAULT_APPROX_CAPACITY_BLOCKS",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_EVENT_LAG_S",
    "DEFAULT_PENDING_TTL_S",
    "InstanceIndexStats",
    "Mode",
    "PrefixIndex",
    "block_keys",
]
