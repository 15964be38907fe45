"""The sequence rules of one instance's KV events, without I/O (`EventStream`).

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
tell live events from lagging ones (see `kvtransfer.router.routing.prefix_index`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.router.routing.kv_events.wire import EventDecodeError, decode_batch
from kvtransfer.router.routing.prefix_index import PrefixIndex

logger = logging.getLogger("kvtransfer.router.kv_events")


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
