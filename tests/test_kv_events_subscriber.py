"""The router's KV event subscriber: sequence numbers, gaps filled from replay or not, lost,
reordered and undecodable messages, publisher restarts, stopped events; and the asyncio
subscriber with our publisher over inproc ZeroMQ. After each mishap the index must never claim
a block the engine dropped."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from waiting import wait_until_async

from kvtransfer.router.routing.kv_events import (
    EventSource,
    EventStream,
    KVEventSubscriber,
    ReplayRequest,
)
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    encode_batch,
)

pytestmark = pytest.mark.unit

BS = 4
A = tuple(range(1, 13))  # 3 blocks
B = tuple(range(100, 112))  # 3 blocks, nothing shared with A
C = tuple(range(200, 212))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _payload(*events) -> bytes:
    return encode_batch(EventBatch(1.0, tuple(events), 0))


def _stored(tokens, name: str) -> BlockStored:
    hashes = tuple(f"{name}{i}".encode() for i in range(len(tokens) // BS))
    return BlockStored(hashes, None, tuple(tokens), BS)


def _removed(name: str, count: int = 3) -> BlockRemoved:
    return BlockRemoved(tuple(f"{name}{i}".encode() for i in range(count)))


# The publisher's history: A stored, B stored, A removed, C stored, B removed.
HISTORY = [
    _payload(_stored(A, "a")),
    _payload(_stored(B, "b")),
    _payload(_removed("a")),
    _payload(_stored(C, "c")),
    _payload(_removed("b")),
]


def _engine_after(seq: int) -> dict[tuple[int, ...], int]:
    """What the engine holds after message ``seq``."""
    held = {A: 3, B: 3, C: 3}
    present = {A: 0 <= seq < 2, B: 1 <= seq < 4, C: seq >= 3}
    return {p: held[p] for p, yes in present.items() if yes}


def _stream(has_replay: bool, clock: Clock | None = None):
    index = PrefixIndex(default_block_size=BS, clock=clock or Clock())
    stream = EventStream(index, "e", has_replay=has_replay)
    return index, stream


def _claims(index: PrefixIndex) -> dict[tuple[int, ...], int]:
    return {p: n for p in (A, B, C) if (n := index.match(p).get("e", 0))}


def _assert_subset_of_engine(index: PrefixIndex, seq: int) -> None:
    held = _engine_after(seq)
    for prompt, count in _claims(index).items():
        assert count <= held.get(prompt, 0), (prompt, count, held)


def _replay(start: int, upto: int, first_kept: int = 0):
    return [(s, HISTORY[s]) for s in range(max(start, first_kept), upto + 1)]


def test_in_order_messages_build_the_engines_state_and_duplicates_are_skipped():
    index, stream = _stream(has_replay=False)
    assert stream.start() is None
    assert index.mode("e") == "precise"
    for seq, payload in enumerate(HISTORY):
        assert stream.on_message(seq, payload) is None
        assert _claims(index) == _engine_after(seq)
    assert stream.num_gaps == stream.num_unfilled == 0


def test_a_gap_is_filled_from_replay_exactly():
    index, stream = _stream(has_replay=True)
    request = stream.start()
    assert request == ReplayRequest(0)
    stream.on_replay(request, [])  # nothing published yet
    stream.on_message(0, HISTORY[0])
    stream.on_message(1, HISTORY[1])
    # 2 and 3 are lost: 4 asks for them, and the index waits out of sync meanwhile.
    request = stream.on_message(4, HISTORY[4])
    assert request == ReplayRequest(2)
    assert index.mode("e") == "approximate"
    stream.on_replay(request, _replay(2, 4), live=(4, HISTORY[4]))
    assert _claims(index) == _engine_after(4) == {C: 3}
    assert index.mode("e") == "precise"
    assert (stream.num_gaps, stream.num_unfilled) == (1, 0)
    # The replay's copies already applied: later duplicates change nothing.
    assert stream.on_message(5, _payload(_removed("c", 1))) is None
    assert _claims(index) == {}


@pytest.mark.parametrize("how", ["buffer lost it", "replay failed", "no replay socket"])
def test_a_gap_that_cannot_be_filled_restarts_from_empty_never_claiming_dropped_blocks(how):
    index, stream = _stream(has_replay=how != "no replay socket")
    request = stream.start()
    if request is not None:
        stream.on_replay(request, [])
    stream.on_message(0, HISTORY[0])  # A stored
    stream.on_message(1, HISTORY[1])  # B stored
    # Lost: 2 (A removed), 3 (C stored). Live: 4 (B removed)... then a new store of A.
    request = stream.on_message(4, HISTORY[4])
    if how == "buffer lost it":
        stream.on_replay(request, _replay(2, 4, first_kept=4), live=(4, HISTORY[4]))
    elif how == "replay failed":
        stream.on_replay(request, None, live=(4, HISTORY[4]))
    else:
        assert request is None
    assert stream.num_unfilled == 1
    assert _claims(index) == {}  # A (removed in the gap) and B are not claimed
    _assert_subset_of_engine(index, 4)
    assert index.mode("e") == "precise"
    stream.on_message(5, _payload(_stored(A, "a2")))
    assert _claims(index) == {A: 3}


def test_a_publisher_restart_forgets_both_sets_and_replays_from_zero():
    index, stream = _stream(has_replay=True)
    stream.on_replay(stream.start(), [])
    for seq in range(3):
        stream.on_message(seq, HISTORY[seq])
    index.observe("e", B)
    assert _claims(index) == {B: 3}
    # The engine restarted (empty cache): its publisher counts from 0 again.
    fresh = _payload(_stored(C, "new"))
    request = stream.on_message(0, fresh)
    assert request == ReplayRequest(0)
    assert stream.num_restarts == 1
    assert _claims(index) == {}  # the approximate set is gone too
    stream.on_replay(request, [(0, fresh)], live=(0, fresh))
    assert _claims(index) == {C: 3}
    assert stream.on_message(1, _payload()) is None  # its next message: no restart
    assert stream.num_restarts == 1


def test_pending_picks_count_until_stored_and_never_survive_a_restart():
    index, stream = _stream(has_replay=True)
    stream.on_replay(stream.start(), [])
    stream.on_message(0, HISTORY[0])  # A stored
    index.observe("e", C, pick="r1")  # routed there; the engine has not announced C yet
    assert _claims(index) == {A: 3, C: 3}
    # The engine restarted before storing C: nothing it held, nothing pending, is claimed.
    request = stream.on_message(0, _payload())
    assert stream.num_restarts == 1 and _claims(index) == {}
    stream.on_replay(request, [(0, _payload())])
    index.observe("e", C, pick="r2")
    stream.on_message(1, _payload(_stored(C, "c")))  # stored: the events answer from here on
    assert index.stats()[0].pending_blocks == 0
    stream.on_message(2, _payload(_removed("c")))
    assert _claims(index) == {}


def test_a_restart_seen_only_through_a_resync_replay():
    """Reconnected to a restarted publisher: its replay ends below what was applied before."""
    index, stream = _stream(has_replay=True)
    stream.on_replay(stream.start(), [])
    for seq in range(4):
        stream.on_message(seq, HISTORY[seq])
    index.observe("e", A)
    stream.on_disconnect()
    assert index.mode("e") == "approximate"
    fresh = [(0, _payload(_stored(B, "new")))]
    stream.on_replay(stream.resync(), fresh)
    assert stream.num_restarts == 1
    assert _claims(index) == {B: 3}  # neither the old precise set nor the approximate A
    # Its live messages the replay also held are duplicates, not another restart.
    stream.on_message(0, fresh[0][1])
    stream.on_message(1, _payload())
    assert stream.num_restarts == 1 and _claims(index) == {B: 3}


def test_a_resync_of_a_publisher_that_did_not_restart_keeps_going():
    index, stream = _stream(has_replay=True)
    stream.on_replay(stream.start(), [])
    for seq in range(2):
        stream.on_message(seq, HISTORY[seq])
    index.observe("e", A)
    stream.on_disconnect()
    stream.on_replay(stream.resync(), _replay(0, 3))  # it published 2 and 3 meanwhile
    assert stream.num_restarts == 0
    assert _claims(index) == _engine_after(3)
    stream.on_message(4, HISTORY[4])
    assert _claims(index) == _engine_after(4)


def test_a_reordered_message_is_taken_for_a_restart_and_the_index_rebuilt():
    index, stream = _stream(has_replay=True)
    stream.on_replay(stream.start(), [])
    for seq in (0, 1, 2):
        stream.on_message(seq, HISTORY[seq])
    request = stream.on_message(1, HISTORY[1])  # older than the last live one
    assert request == ReplayRequest(0)
    stream.on_replay(request, _replay(0, 2))
    assert _claims(index) == _engine_after(2)


def test_an_undecodable_message_clears_the_precise_set():
    index, stream = _stream(has_replay=False)
    stream.start()
    stream.on_message(0, HISTORY[0])
    stream.on_message(1, b"\xc1 not msgpack")
    assert stream.num_undecodable == 1
    assert _claims(index) == {}
    stream.on_message(2, HISTORY[1])
    assert _claims(index) == {B: 3}


def test_stopped_events_fall_back_to_the_approximate_set_and_come_back():
    clock = Clock()
    index, stream = _stream(has_replay=False, clock=clock)
    stream.start()
    stream.on_message(0, HISTORY[0])  # A stored
    index.observe("e", B)  # routed there; the engine will store B, but no event comes
    clock.now += index.max_event_lag_s + 0.1
    assert index.mode("e") == "approximate"
    assert _claims(index) == {B: 3}  # what was routed there, not a stale "nothing"
    stream.on_message(1, HISTORY[1])  # events resume in sequence
    assert index.mode("e") == "precise"
    assert _claims(index) == {A: 3, B: 3}


# ---------------------------------------------------------------------- over ZeroMQ (inproc)


def _publish(publisher: KVEventPublisher, tokens, name: str) -> None:
    hashes = [f"{name}{i}".encode() for i in range(len(tokens) // BS)]
    publisher.blocks_stored(hashes, None, list(tokens), BS)


def test_subscriber_replays_what_came_before_it_then_follows_live_events():
    async def run() -> None:
        context = zmq.asyncio.Context()
        publisher = KVEventPublisher(
            "inproc://ev", replay_endpoint="inproc://ev-replay", context=context, heartbeat_s=0.05
        )
        publisher.start()
        index = PrefixIndex(default_block_size=BS)
        subscriber = KVEventSubscriber(
            index, EventSource("e", publisher.endpoint, publisher.replay_endpoint), context=context
        )
        try:
            _publish(publisher, A, "a")  # before anyone listens: only the replay has it
            await wait_until_async(
                _async(lambda: publisher.num_published >= 2), "A published", timeout=10
            )
            await subscriber.start()
            await wait_until_async(_async(lambda: index.match(A) == {"e": 3}), "A", timeout=10)
            await wait_until_async(
                _async(lambda: index.stats()[0].seconds_since_message is not None),
                "a live heartbeat",
                timeout=10,
            )
            _publish(publisher, B, "b")
            publisher.blocks_removed([b"a0"])
            await wait_until_async(_async(lambda: index.match(B) == {"e": 3}), "B", timeout=10)
            await wait_until_async(_async(lambda: index.match(A) == {}), "A removed", timeout=10)
            assert index.mode("e") == "precise"
            assert subscriber.stream.num_unfilled == 0
            publisher.all_blocks_cleared()
            await wait_until_async(_async(lambda: index.match(B) == {}), "cleared", timeout=10)
        finally:
            await subscriber.close()
            publisher.close()
            context.term()
        assert index.mode("e") == "approximate"  # closed: detached

    asyncio.run(run())


def test_a_gap_on_the_wire_is_filled_from_the_publishers_replay_socket():
    """Our publisher's messages relayed to the subscriber with one left out: the subscriber
    sees the hole, asks the publisher's replay socket, and ends with the engine's state."""

    async def run() -> None:
        context = zmq.asyncio.Context()
        publisher = KVEventPublisher(
            "inproc://origin",
            replay_endpoint="inproc://origin-replay",
            context=context,
            heartbeat_s=600,  # no heartbeat among the four batches
        )
        publisher.start()
        sync = zmq.Context.shadow(context.underlying)
        tap = sync.socket(zmq.SUB)
        tap.setsockopt(zmq.SUBSCRIBE, b"")
        tap.setsockopt(zmq.RCVTIMEO, 10_000)
        tap.connect(publisher.endpoint)
        relay = sync.socket(zmq.XPUB)  # an XPUB tells when the subscription has arrived
        relay.setsockopt(zmq.RCVTIMEO, 10_000)
        relay.bind("inproc://relay")
        index = PrefixIndex(default_block_size=BS)
        subscriber = KVEventSubscriber(
            index, EventSource("e", "inproc://relay", publisher.replay_endpoint), context=context
        )
        try:
            await subscriber.start()
            await asyncio.to_thread(relay.recv)  # the subscriber's subscription
            frames = []
            for publish in (
                lambda: _publish(publisher, A, "a"),
                lambda: _publish(publisher, B, "b"),
                lambda: publisher.blocks_removed([b"a0", b"a1", b"a2"]),
                lambda: _publish(publisher, C, "c"),
            ):
                publish()
                frames.append(await asyncio.to_thread(tap.recv_multipart))  # one batch each
            assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2, 3]
            for seq in (0, 1, 3):  # 2, A's removal, is lost
                relay.send_multipart(frames[seq])
            await wait_until_async(
                _async(lambda: index.match(C) == {"e": 3}), "C through the replay", timeout=10
            )
            assert index.match(A) == {} and index.match(B) == {"e": 3}
            assert (subscriber.stream.num_gaps, subscriber.stream.num_unfilled) == (1, 0)
            assert index.mode("e") == "precise"
        finally:
            await subscriber.close()
            tap.close(linger=0)
            relay.close(linger=0)
            publisher.close()
            context.term()

    asyncio.run(run())


def _async(predicate):
    async def check():
        return predicate()

    return check


def test_unused_stream_never_claims_anything_after_all_blocks_cleared():
    index, stream = _stream(has_replay=False)
    stream.start()
    stream.on_message(0, HISTORY[0])
    index.observe("e", B)
    stream.on_message(1, _payload(AllBlocksCleared()))
    index.detach_events("e")  # even the approximate set was cleared
    assert _claims(index) == {}
