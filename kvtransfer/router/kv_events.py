"""The router's side of KV cache events: one subscriber per instance feeds the `PrefixIndex`.

Reads what vLLM's ``ZmqEventPublisher`` and our daemons (`kvtransfer.serve.kv_events`) send:
three frames per message (topic, 8-byte big-endian sequence number, msgpack ``KVEventBatch``),
events as maps tagged by ``type`` (vLLM 0.32 and 0.33, ours) or as arrays whose first item is
the tag (older vLLM); vLLM 0.33's fields are decoded, unknown ones ignored.

How a subscriber keeps the instance's precise set a subset of what the engine holds:

1. At start it connects its SUB socket and, when the instance has a replay endpoint, asks for
   every buffered message from sequence 0 and applies them; it is then in sync
   (`PrefixIndex.events_synced`). Without replay it starts in sync from the first message it
   gets (an empty index plus an unbroken run of events is still a subset).
2. Each live message: sequence ``next`` is applied; lower is a duplicate (already applied from
   a replay); higher is a gap: missed messages are asked from the replay socket. If the replay
   does not start at ``next`` (gone from the buffer), fails, or times out, or there is no replay
   socket, the precise set is cleared and rebuilt from the messages at hand on.
3. The publisher restarted (its engine's cache is empty) when a live sequence number is not
   above the last live one, or when a resync's replay ends below the highest number applied
   before (or is empty): the instance's index is cleared (both sets) and replayed from 0.
4. A message it cannot decode is a gap that cannot be filled: the precise set is cleared.
5. The SUB socket losing its connection takes the instance out of sync (its approximate set
   answers for it); on every (re)connection (TCP/IPC handshake) it resyncs as in 1 after
   clearing the precise set, which also catches what was published while the subscription was
   on its way.

Every message, heartbeats (empty batches) included, is reported to the index, which uses it to
tell live events from lagging ones (see `kvtransfer.router.prefix_index`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.router.prefix_index import PrefixIndex
from kvtransfer.serve.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

logger = logging.getLogger("kvtransfer.router.kv_events")

DEFAULT_REPLAY_TIMEOUT_S = 2.0


class EventDecodeError(ValueError):
    """A payload that is not a KV event batch."""


# ---------------------------------------------------------------------- decoding


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


# ---------------------------------------------------------------------- sequencing (no I/O)


@dataclass(frozen=True)
class ReplayRequest:
    start_seq: int


class EventStream:
    """The sequence rules of one instance's events (module docstring, 1 to 5), without I/O:
    `on_message` applies a live message or asks for a replay, `on_replay` applies the replay's
    answer (``None``: it failed) and then the live message that asked for it."""

    def __init__(self, index: PrefixIndex, address: str, *, has_replay: bool) -> None:
        self.index = index
        self.address = address
        self.has_replay = has_replay
        self.next_seq: int | None = None  # None: the next message starts the run
        self.last_live: int | None = None  # live messages only: they never go back
        self.high_seq: int | None = None  # the highest applied since the publisher started
        self.num_gaps = 0
        self.num_unfilled = 0
        self.num_restarts = 0
        self.num_undecodable = 0

    def start(self) -> ReplayRequest | None:
        """Attach to the index and `resync`."""
        self.index.attach_events(self.address)
        return self.resync()

    def resync(self) -> ReplayRequest | None:
        """Start a run from an empty precise set; with replay, from what the publisher kept."""
        self.index.events_synced(self.address, False)
        self.index.clear_precise(self.address)
        self.next_seq = None
        if self.has_replay:
            return ReplayRequest(0)
        self.index.events_synced(self.address, True)
        return None

    def on_disconnect(self) -> None:
        self.index.events_synced(self.address, False)

    def on_message(self, seq: int, payload: bytes) -> ReplayRequest | None:
        restarted = self.last_live is not None and seq <= self.last_live
        self.last_live = seq
        if restarted:
            self._restarted(seq)
            if self.has_replay:
                return ReplayRequest(0)
        if self.next_seq is not None and seq > self.next_seq:
            self.num_gaps += 1
            if self.has_replay:
                # Behind the engine until the replay is in: removals may be among the missed.
                self.index.events_synced(self.address, False)
                return ReplayRequest(self.next_seq)
        self._take(seq, payload)
        self.index.events_synced(self.address, True)
        return None

    def on_replay(
        self,
        request: ReplayRequest,
        items: Sequence[tuple[int, bytes]] | None,
        live: tuple[int, bytes] | None = None,
    ) -> None:
        """Apply a replay's answer from ``request.start_seq`` (``None``: it failed), then the
        live message that asked for it."""
        # A resync's replay: a publisher whose messages now end below what was applied before
        # (or that kept none) restarted since, with an empty cache.
        resync = self.next_seq is None and items is not None and self.high_seq is not None
        if resync and (items[-1][0] if items else -1) < self.high_seq:
            self._restarted(items[-1][0] if items else -1)
            # Live messages the replay holds too may still be queued: not restarts.
            self.last_live = None
        # A replay that does not start where asked (or failed) leaves a hole `_take` sees.
        for seq, payload in items or ():
            self._take(seq, payload)
        if live is not None:
            self._take(*live)
        self.index.events_synced(self.address, True)

    def _restarted(self, seq: int) -> None:
        self.num_restarts += 1
        logger.info("KV events of %s: the publisher restarted (at seq %d)", self.address, seq)
        self.index.forget(self.address)
        self.index.events_synced(self.address, False)
        self.next_seq = self.high_seq = None

    def _take(self, seq: int, payload: bytes) -> None:
        """Message ``seq`` of the run: skipped if applied already; after a hole, the run
        starts again from an empty precise set."""
        if self.next_seq is not None:
            if seq < self.next_seq:
                self.index.message_received(self.address)
                return
            if seq > self.next_seq:
                self._unfilled(self.next_seq, seq)
        self._apply(seq, payload)
        self.high_seq = seq if self.high_seq is None else max(self.high_seq, seq)

    def _unfilled(self, missing_from: int, resumed_at: int | None) -> None:
        self.num_unfilled += 1
        logger.warning(
            "KV events of %s: messages from %d on are lost%s; its precise index restarts empty",
            self.address,
            missing_from,
            "" if resumed_at is None else f" (resumed at {resumed_at})",
        )
        self.index.clear_precise(self.address)
        self.next_seq = None

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self.num_undecodable += 1
            logger.warning("KV events of %s: message %d undecodable: %s", self.address, seq, exc)
            self.index.clear_precise(self.address)
        else:
            self.index.apply(self.address, batch.events)
            self.index.message_received(self.address, heartbeat=not batch.events)
        self.next_seq = seq + 1


# ---------------------------------------------------------------------- the sockets


@dataclass(frozen=True)
class EventSource:
    """Where one instance publishes: ``endpoint`` (its PUB), ``replay_endpoint`` (its ROUTER,
    optional), the ``topic`` it publishes under ("" for vLLM's default)."""

    address: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class KVEventSubscriber:
    """One instance's SUB (and replay DEALER) sockets on the router's event loop."""

    def __init__(
        self,
        index: PrefixIndex,
        source: EventSource,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.stream = EventStream(index, source.address, has_replay=bool(source.replay_endpoint))
        self._context = context or zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        # Set while the SUB is connected over TCP/IPC and resynced (inproc never reports it).
        self.connected = asyncio.Event()

    async def start(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        self._monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        sub.connect(self.source.endpoint)
        self._sub = sub
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.source.address}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close()
            self._sub = None
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        self._close_replay()
        self.stream.index.detach_events(self.source.address)

    async def _run(self) -> None:
        stream = self.stream
        assert self._sub is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        # At once (inproc has no connection events), then again with every (re)connection:
        # the SUB's subscription reaches the publisher once the handshake succeeded.
        await self._replay_then(stream.start())
        try:
            while True:
                ready = dict(await poller.poll())
                if self._monitor in ready:
                    event = parse_monitor_message(await self._monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        logger.info("KV events of %s: disconnected", self.source.address)
                        self.connected.clear()
                        stream.on_disconnect()
                    elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        await self._replay_then(stream.resync())
                        self.connected.set()
                if self._sub in ready:
                    frames = await self._sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        stream.num_undecodable += 1
                        continue
                    seq = int.from_bytes(frames[1], "big")
                    request = stream.on_message(seq, frames[2])
                    if request is not None:
                        stream.on_replay(request, await self._fetch(request), (seq, frames[2]))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV events of %s: the subscriber stopped", self.source.address)
            stream.on_disconnect()

    async def _replay_then(self, request: ReplayRequest | None) -> None:
        if request is not None:
            self.stream.on_replay(request, await self._fetch(request))

    async def _fetch(self, request: ReplayRequest) -> list[tuple[int, bytes]] | None:
        """The replay socket's answer from ``request.start_seq`` on; ``None`` if it failed."""
        endpoint = self.source.replay_endpoint
        if endpoint is None:
            return None
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(endpoint)
        items: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self._replay_timeout_s):
                await self._replay.send_multipart([b"", request.start_seq.to_bytes(8, "big")])
                while True:
                    frames = await self._replay.recv_multipart()
                    if len(frames) != 4:
                        raise EventDecodeError(f"a replay message of {len(frames)} frames")
                    _, _, seq_bytes, payload = frames
                    if seq_bytes == END_OF_REPLAY:
                        return items
                    items.append((int.from_bytes(seq_bytes, "big"), payload))
        except (TimeoutError, EventDecodeError, zmq.ZMQError) as exc:
            logger.warning("KV events of %s: replay failed: %r", self.source.address, exc)
            # Answers still on their way would be read as the next request's.
            self._close_replay()
            return None

    def _close_replay(self) -> None:
        if self._replay is not None:
            self._replay.close()
            self._replay = None


class KVEventSubscribers:
    """The router's subscribers, one per instance publishing events."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
    ) -> None:
        self.index = index
        self._context = context
        self._replay_timeout_s = replay_timeout_s
        self._subscribers: dict[str, KVEventSubscriber] = {}

    async def add(self, source: EventSource) -> KVEventSubscriber:
        """Subscribe to ``source`` (replacing an earlier subscription for its address)."""
        await self.remove(source.address)
        subscriber = KVEventSubscriber(
            self.index, source, context=self._context, replay_timeout_s=self._replay_timeout_s
        )
        self._subscribers[source.address] = subscriber
        await subscriber.start()
        return subscriber

    async def remove(self, address: str) -> None:
        subscriber = self._subscribers.pop(address, None)
        if subscriber is not None:
            await subscriber.close()

    def get(self, address: str) -> KVEventSubscriber | None:
        return self._subscribers.get(address)

    async def close(self) -> None:
        for address in list(self._subscribers):
            await self.remove(address)
