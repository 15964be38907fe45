"""The sockets: one subscriber per instance (`KVEventSubscriber`: SUB, and a replay DEALER when
the instance has one) on the router's event loop, feeding its `EventStream`; `KVEventSubscribers`
keeps one per instance of a role."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.router.routing.kv_events.stream import EventStream, ReplayRequest
from kvtransfer.router.routing.kv_events.wire import EventDecodeError
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve.kv_events import (
    END_OF_REPLAY,
)

logger = logging.getLogger("kvtransfer.router.kv_events")

DEFAULT_REPLAY_TIMEOUT_S = 2.0


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
