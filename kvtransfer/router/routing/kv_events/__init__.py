"""The router's side of KV cache events: one subscriber per instance feeds the `PrefixIndex`.

The messages read off the wire (`wire`), the sequence rules that keep an instance's precise set
a subset of what its engine holds (`stream`), the sockets (`subscriber`).
"""

from __future__ import annotations

from kvtransfer.router.routing.kv_events.stream import EventStream, ReplayRequest
from kvtransfer.router.routing.kv_events.subscriber import (
    EventSource,
    KVEventSubscriber,
    KVEventSubscribers,
)
from kvtransfer.router.routing.kv_events.wire import EventDecodeError, decode_batch

__all__ = [
    "EventDecodeError",
    "EventSource",
    "EventStream",
    "KVEventSubscriber",
    "KVEventSubscribers",
    "ReplayRequest",
    "decode_batch",
]
