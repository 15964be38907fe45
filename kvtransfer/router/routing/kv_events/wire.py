"""KV cache events off the wire, as the router reads them.

Reads what vLLM's ``ZmqEventPublisher`` and our daemons (`kvtransfer.serve.kv_events`) send:
three frames per message (topic, 8-byte big-endian sequence number, msgpack ``KVEventBatch``),
events as maps tagged by ``type`` (vLLM 0.32 and 0.33, ours) or as arrays whose first item is
the tag (older vLLM); vLLM 0.33's fields are decoded, unknown ones ignored.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvtransfer.serve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


def decode_batch(payload: bytes) -> EventBatch:
    """A ``KVEventBatch`` payload (ours or vLLM's, map or array events); events of unknown type
    are left out."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventDecodeError("not an event batch: want [ts, [events...], dp_rank]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise EventDecodeError(f"batch ts is {type(ts).__name__}, not a number")
    dp_rank = raw[2] if len(raw) > 2 else None
    events = tuple(e for e in (_event(item) for item in raw[1]) if e is not None)
    return EventBatch(float(ts), events, dp_rank)


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


def _event(item: Any) -> KVCacheEvent | None:
    if isinstance(item, dict):
        kind = item.get("type")
        fields = item
    elif isinstance(item, list | tuple) and item and isinstance(item[0], str):
        kind = item[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, item[1:], strict=False))
    else:
        raise EventDecodeError(f"an event is a {type(item).__name__}, not a map or an array")
    try:
        if kind == "BlockStored":
            extra = fields.get("extra_keys")
            lookahead = fields.get("lookahead_token_ids")
            return BlockStored(
                block_hashes=tuple(_hash(h) for h in fields["block_hashes"]),
                parent_block_hash=_optional_hash(fields["parent_block_hash"]),
                token_ids=tuple(int(t) for t in fields["token_ids"]),
                block_size=int(fields["block_size"]),
                lora_id=fields.get("lora_id"),
                medium=fields.get("medium"),
                lora_name=fields.get("lora_name"),
                extra_keys=None if extra is None else tuple(extra),
                group_idx=fields.get("group_idx"),
                kv_cache_spec_kind=fields.get("kv_cache_spec_kind"),
                kv_cache_spec_sliding_window=fields.get("kv_cache_spec_sliding_window"),
                locality=fields.get("locality"),
                ownership=fields.get("ownership"),
                session_id=fields.get("session_id"),
                lookahead_token_ids=None
                if lookahead is None
                else tuple(tuple(int(t) for t in block) for block in lookahead),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=tuple(_hash(h) for h in fields["block_hashes"]),
                medium=fields.get("medium"),
                group_idx=fields.get("group_idx"),
                locality=fields.get("locality"),
                ownership=fields.get("ownership"),
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"malformed {kind} event: {exc!r}") from None
    return None


def _hash(value: Any) -> bytes | int:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise EventDecodeError(f"a block hash is {type(value).__name__}, not bytes or int")


def _optional_hash(value: Any) -> bytes | int | None:
    return None if value is None else _hash(value)
