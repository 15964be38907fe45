"""KV cache events: what enters and leaves a daemon's prefix cache, published over ZeroMQ in
vLLM's wire format, so that one consumer (the router's index) reads our daemons and vLLM alike.

What a subscriber can rely on:

* Every message on the PUB socket is three frames: the topic, an 8-byte big-endian sequence
  number (0, 1, 2, ... from the publisher's start, one per message) and a msgpack payload laid
  out as vLLM 0.33's ``KVEventBatch`` encodes it with msgspec: ``[ts, [event, ...], dp_rank]``,
  each event a map whose first key ``type`` names it (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``), fields in vLLM's order, optional fields left out when unset. 0.33's
  fields are published where we know them: ``locality`` ("LOCAL": the engine's own cache).
  vLLM 0.32 reads the same payloads (its decoder ignores fields it does not declare; only a
  ``BlockStored`` map header is wider than 0.32 writes it). ``vllm_stage/check_kv_events.py``
  checks the bytes against vLLM 0.33's encoder, and both releases' typed decoders.
* Block hashes are this engine's (`hash_block_tokens`, 32 bytes), not vLLM's: a consumer rebuilds
  its own chain from ``token_ids`` and ``parent_block_hash``.
* Events are in the order the block manager made them; nothing is published twice.
* When idle, an empty batch goes out every ``heartbeat_s`` (vLLM publishes no empty batches, so
  an empty batch tells a consumer this publisher sends heartbeats and silence means trouble).
* The engine thread never waits: events go through a bounded queue to a sender thread. If the
  queue overflows, the events dropped are replaced by an ``AllBlocksCleared`` (consumers forget
  this engine's blocks: they may under-count its cache afterwards, never over-count it).
* With a replay endpoint (a ROUTER socket), a client sends ``[b"", start_seq (8 bytes)]`` and
  gets ``[b"", topic, seq, payload]`` for every buffered message from ``start_seq`` on, then
  ``[b"", b"", -1 (8 bytes, signed), b""]``, as vLLM's replay answers. The buffer holds (at
  least) the last ``buffer_steps`` batches of events, and the heartbeats between them however
  long the daemon idled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

logger = logging.getLogger("kvtransfer.serve.kv_events")

EngineHash = bytes | int

MEDIUM_GPU = "GPU"  # vLLM's name for an engine's own KV cache, whatever the device
LOCALITY_LOCAL = "LOCAL"  # vLLM 0.33: the tier is the publisher's own (not remote storage)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HEARTBEAT_S = 1.0
_MAX_QUEUED_EVENTS = 100_000
_MAX_EVENTS_PER_BATCH = 4096
_HWM = 100_000
_TICK_S = 0.02
_HEARTBEAT_MARK = b""  # in the replay buffer: a run of heartbeats


# ---------------------------------------------------------------------- the wire format


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # Per block: what else the engine hashed (LoRA name, multimodal ids, cache salt); None if
    # nothing.
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    # vLLM 0.33's trailing fields.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # Per block: the tokens past it that its hash includes (lookahead hashing); None if off.
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    """The payload vLLM 0.33's msgspec encoder writes for the same ``KVEventBatch``."""
    events = batch.events
    return b"".join(
        (
            _array_header(3),
            _pack(batch.ts),
            _array_header(len(events)),
            *(_encode_event(e) for e in events),
            _pack(batch.data_parallel_rank),
        )
    )


def _encode_event(event: KVCacheEvent) -> bytes:
    fields = _event_map(event)
    if isinstance(event, BlockStored):
        # msgspec sizes a struct's map header by the fields it declares, before leaving the
        # defaults out: vLLM 0.33's BlockStored (15 fields and the tag) gets a 16-bit one.
        header = b"\xde" + len(fields).to_bytes(2, "big")
    else:
        header = bytes([0x80 | len(fields)])  # BlockRemoved, AllBlocksCleared: under 16
    return header + b"".join(_pack(k) + _pack(v) for k, v in fields.items())


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    if length < 2**16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _event_map(event: KVCacheEvent) -> dict[str, Any]:
    # Insertion order is wire order: the tag, then vLLM's fields in declaration order; fields
    # with a default are left out while at it (msgspec's omit_defaults).
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            fields["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        if event.group_idx is not None:
            fields["group_idx"] = event.group_idx
        _put(fields, "kv_cache_spec_kind", event.kv_cache_spec_kind)
        _put(fields, "kv_cache_spec_sliding_window", event.kv_cache_spec_sliding_window)
        _put(fields, "locality", event.locality)
        _put(fields, "ownership", event.ownership)
        _put(fields, "session_id", event.session_id)
        if event.lookahead_token_ids is not None:
            fields["lookahead_token_ids"] = [list(t) for t in event.lookahead_token_ids]
        return fields
    if isinstance(event, BlockRemoved):
        fields = {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
        if event.group_idx is not None:
            fields["group_idx"] = event.group_idx
        _put(fields, "locality", event.locality)
        _put(fields, "ownership", event.ownership)
        return fields
    return {"type": "AllBlocksCleared"}


def _put(fields: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        fields[name] = value


# ---------------------------------------------------------------------- the publisher


class KVEventPublisher:
    """A `KVCacheEventSink` that publishes what it is told (see the module docstring).

    ``endpoint`` and ``replay_endpoint`` are bound (``tcp://*:5557``, ``tcp://127.0.0.1:0`` for
    any free port, ``ipc://...``, ``inproc://...``); `start` returns once both are bound, and
    `endpoint` / `replay_endpoint` then give the addresses bound.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        max_queued_events: int = _MAX_QUEUED_EVENTS,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        if buffer_steps < 1 or heartbeat_s <= 0 or max_queued_events < 1:
            raise ValueError("buffer_steps and max_queued_events must be >= 1, heartbeat_s > 0")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._heartbeat_s = heartbeat_s
        self._dp_rank = data_parallel_rank
        # A plain (blocking) context for the sender thread, even over an asyncio one's sockets.
        self._context = zmq.Context.shadow((context or zmq.Context.instance()).underlying)
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(max_queued_events)
        # (first seq, last seq, payload): one entry per batch of events, or per run of
        # heartbeats (all alike), so an idle spell does not push events out of the replay.
        self._buffer: deque[tuple[int, int, bytes]] = deque(maxlen=2 * buffer_steps + 1)
        self._overflowed = False
        self._stopping = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.num_published = 0  # messages, heartbeats included
        self.num_dropped = 0  # events lost to a full queue

    # ------------------------------------------------------------------ KVCacheEventSink

    def blocks_stored(
        self,
        block_hashes: Sequence[EngineHash],
        parent_hash: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        self._put(("stored", block_hashes, parent_hash, token_ids, block_size))

    def blocks_removed(self, block_hashes: Sequence[EngineHash]) -> None:
        self._put(("removed", block_hashes))

    def all_blocks_cleared(self) -> None:
        self._put(("cleared",))

    def _put(self, item: tuple[Any, ...]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._overflowed = True
            self.num_dropped += 1

    # ------------------------------------------------------------------ life cycle

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind and start sending; raises the bind's `zmq.ZMQError` (e.g. port in use)."""
        self._thread.start()
        if not self._bound.wait(timeout_s):
            raise TimeoutError(f"KV events: could not bind {self.endpoint} in {timeout_s:g} s")
        if self._bind_error is not None:
            raise self._bind_error

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets; idempotent."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the sender thread

    def _run(self) -> None:
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, _HWM)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            self.endpoint = _bind(pub, self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(replay, self.replay_endpoint)
        except BaseException as exc:
            pub.close()
            if replay is not None:
                replay.close()
            self._bind_error = exc
            self._bound.set()
            return
        self._bound.set()
        seq = 0
        last_sent = time.monotonic()
        try:
            while not (self._stopping.is_set() and self._queue.empty()):
                while replay is not None and replay.poll(0):
                    self._answer_replay(replay)
                events = self._take(_TICK_S)
                if self._overflowed:
                    self._overflowed = False
                    events.append(AllBlocksCleared())
                if not events and time.monotonic() - last_sent < self._heartbeat_s:
                    continue
                batch = EventBatch(time.time(), tuple(events), self._dp_rank)
                payload = encode_batch(batch)
                seq_bytes = seq.to_bytes(8, "big")
                pub.send_multipart((self._topic, seq_bytes, payload))
                last = self._buffer[-1] if self._buffer else None
                if not events and last is not None and last[2] == _HEARTBEAT_MARK:
                    self._buffer[-1] = (last[0], seq, _HEARTBEAT_MARK)
                else:
                    self._buffer.append((seq, seq, payload if events else _HEARTBEAT_MARK))
                seq += 1
                self.num_published += 1
                last_sent = time.monotonic()
        except Exception:
            logger.exception("KV events: the sender stopped; consumers will see silence")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _take(self, timeout_s: float) -> list[KVCacheEvent]:
        """Whatever is queued as events (waits ``timeout_s`` for the first), consecutive
        removals merged into one."""
        try:
            items = [self._queue.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while len(items) < _MAX_EVENTS_PER_BATCH:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        events: list[KVCacheEvent] = []
        for item in items:
            kind = item[0]
            if kind == "stored":
                _, hashes, parent, tokens, block_size = item
                events.append(
                    BlockStored(
                        tuple(hashes),
                        parent,
                        tuple(tokens),
                        block_size,
                        group_idx=0,
                        locality=LOCALITY_LOCAL,
                    )
                )
            elif kind == "removed":
                if events and isinstance(events[-1], BlockRemoved):
                    merged = events[-1].block_hashes + tuple(item[1])
                    events[-1] = BlockRemoved(merged, group_idx=0, locality=LOCALITY_LOCAL)
                else:
                    events.append(
                        BlockRemoved(tuple(item[1]), group_idx=0, locality=LOCALITY_LOCAL)
                    )
            else:
                events.append(AllBlocksCleared())
        return events

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        start_seq = int.from_bytes(start, "big")
        for first, last, payload in list(self._buffer):
            if payload == _HEARTBEAT_MARK:
                payload = encode_batch(EventBatch(time.time(), (), self._dp_rank))
            for seq in range(max(first, start_seq), last + 1):
                replay.send_multipart((client, empty, self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, empty, b"", END_OF_REPLAY, b""))


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    socket.bind(endpoint)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)
