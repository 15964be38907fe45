"""KV cache events, the publishing side: what the block manager reports, the wire format
(round trip through the router's decoder, older vLLM's array events), and the publisher over
inproc ZeroMQ (frames, sequence numbers, heartbeats, replay, overflow). Byte equality with vLLM's
own encoder is checked in the vLLM stage (``vllm_stage/check_kv_events.py``)."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from engine_helpers.scheduler_helpers import make_request
from waiting import wait_until

from kvtransfer.engine.scheduler.block_manager import BlockManager, hash_block_tokens
from kvtransfer.router.routing.kv_events import EventDecodeError, decode_batch
from kvtransfer.serve.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    encode_batch,
)

pytestmark = pytest.mark.unit

BS = 4


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size) -> None:
        self.events.append(("stored", list(block_hashes), parent_hash, list(token_ids), block_size))

    def blocks_removed(self, block_hashes) -> None:
        self.events.append(("removed", list(block_hashes)))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared",))


def _chain(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // BS):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else b"", tokens[i * BS : (i + 1) * BS])
        )
    return hashes


def _run(bm: BlockManager, rid: str, tokens: list[int], free: bool = True):
    request = make_request(rid, tokens)
    hits, num_hit = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, len(tokens) - num_hit, hits) is not None
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request, len(tokens))
    if free:
        bm.free(rid)
    return request


# ---------------------------------------------------------------------- the block manager


def test_block_manager_reports_stored_runs_with_parent_and_tokens():
    bm = BlockManager(num_blocks=16, block_size=BS)
    sink = bm.event_sink = RecordingSink()
    a = list(range(10))  # 2 full blocks
    _run(bm, "a", a)
    h = _chain(a)
    assert sink.events == [("stored", h, None, a[:8], BS)]
    # Sharing the first two blocks: only the third is new, its parent the second.
    b = [*a[:8], 50, 51, 52, 53, 54]
    _run(bm, "b", b)
    hb = _chain(b)
    assert sink.events[1:] == [("stored", [hb[2]], hb[1], b[8:12], BS)]


def test_block_manager_splits_runs_around_a_block_another_request_serves():
    bm = BlockManager(num_blocks=16, block_size=BS)
    sink = bm.event_sink = RecordingSink()
    tokens = list(range(12))
    # Two requests computing the same prompt at once: the second's blocks are duplicates.
    first = make_request("x", [*tokens, 99])
    second = make_request("y", [*tokens, 99])
    for request in (first, second):
        assert bm.allocate_slots(request, 13) is not None
        request.num_computed_tokens = 13
    bm.cache_full_blocks(first, 8)  # blocks 0, 1
    bm.cache_full_blocks(second, 4)  # block 0: a duplicate, not reported
    bm.cache_full_blocks(first, 12)  # block 2, chained to block 1
    bm.cache_full_blocks(second, 12)  # blocks 1, 2 served already: nothing
    h = _chain(tokens)
    assert sink.events == [
        ("stored", h[:2], None, tokens[:8], BS),
        ("stored", [h[2]], h[1], tokens[8:12], BS),
    ]


def test_block_manager_reports_eviction_corruption_and_reset():
    bm = BlockManager(num_blocks=4, block_size=BS)
    sink = bm.event_sink = RecordingSink()
    a = list(range(9))
    _run(bm, "a", a)
    h = _chain(a)
    sink.events.clear()
    # Allocating all four blocks evicts both cached ones (LRU from the free list's front).
    _run(bm, "big", list(range(100, 116)), free=False)
    *removed, stored = sink.events
    assert sorted(e[1][0] for e in removed) == sorted(h)
    assert all(e[0] == "removed" for e in removed)
    assert stored == ("stored", _chain(list(range(100, 116))), None, list(range(100, 116)), BS)
    bm.free("big")
    sink.events.clear()
    c = _run(bm, "c", list(range(200, 209)), free=False)
    hc = _chain(list(range(200, 209)))
    bm.evict_blocks(bm.get_block_ids(c.request_id)[:1])
    assert sink.events[-1] == ("removed", [hc[0]])
    bm.reset_prefix_cache()
    assert sink.events[-1] == ("cleared",)
    bm.free("c")


def test_no_sink_no_events_and_prefix_caching_off_reports_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    _run(bm, "a", list(range(9)))  # the default sink takes calls silently
    off = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    sink = off.event_sink = RecordingSink()
    _run(off, "a", list(range(9)))
    assert sink.events == []


# ---------------------------------------------------------------------- the wire format


def _batch() -> EventBatch:
    h = _chain(list(range(8)))
    return EventBatch(
        12.5,
        (
            BlockStored(tuple(h), None, tuple(range(8)), BS, group_idx=0),
            BlockStored((2**64 - 1,), 7, (2**31 - 1, 0, 1, 2), BS),
            BlockStored(
                (5,),
                None,
                (1, 2, 3, 4),
                BS,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=64,
                locality="LOCAL",
                ownership="tier-1",
                session_id="s-1",
                lookahead_token_ids=((5, 6),),
            ),
            BlockRemoved((h[1], 2**64 - 1), group_idx=0, locality="LOCAL", ownership="tier-1"),
            AllBlocksCleared(),
        ),
        0,
    )


def test_round_trip_through_the_router_decoder():
    assert decode_batch(encode_batch(_batch())) == _batch()


def test_wire_layout_is_vllm_0_33s():
    payload = encode_batch(_batch())
    raw = msgpack.unpackb(payload, raw=False)
    assert raw[0] == 12.5 and raw[2] == 0
    stored, _, full, removed, cleared = raw[1]
    declared = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
    ]
    assert list(stored) == declared
    assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
    # vLLM 0.33's trailing fields, in its order, when set.
    assert list(full) == [
        *declared,
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ]
    assert full["lookahead_token_ids"] == [[5, 6]]
    assert list(removed) == ["type", "block_hashes", "medium", "group_idx", "locality", "ownership"]
    assert cleared == {"type": "AllBlocksCleared"}
    # Fields left at their default are left out; the batch keeps its dp rank slot.
    assert "group_idx" not in raw[1][1]
    assert msgpack.unpackb(encode_batch(EventBatch(1.0, (), None)), raw=False) == [1.0, [], None]
    # msgspec gives a struct of 16 declared fields a 16-bit map header, however many it
    # writes: so does ours, for BlockStored only.
    first_event = payload.index(b"\xa4type") - 3
    assert payload[first_event : first_event + 3] == b"\xde\x00\x09"
    assert encode_batch(EventBatch(1.0, (BlockRemoved((1,)),), None)).startswith(
        b"\x93\xcb" + msgpack.packb(1.0)[1:] + b"\x91\x83\xa4type"
    )


def test_decoder_reads_array_events_and_ignores_unknown_ones():
    h = b"\x07" * 32
    payload = msgpack.packb(
        [
            3.0,
            [
                ["BlockStored", [h], None, [1, 2, 3, 4], 4, None, "GPU"],
                ["BlockRemoved", [h], "GPU"],
                ["AllBlocksCleared"],
                {"type": "SomethingNew", "x": 1},
                {"type": "BlockRemoved", "block_hashes": [5], "medium": None, "later": 1},
            ],
        ],
        use_bin_type=True,
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((h,), None, (1, 2, 3, 4), 4, None, "GPU", None),
        BlockRemoved((h,), "GPU"),
        AllBlocksCleared(),
        BlockRemoved((5,), None),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["text"]}]]),
        msgpack.packb([1.0, [7]]),
    ],
)
def test_decoder_refuses_what_is_not_an_event_batch(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


# ---------------------------------------------------------------------- the publisher


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.term()


def _publisher(context, name: str, **kwargs) -> KVEventPublisher:
    return KVEventPublisher(
        f"inproc://{name}", replay_endpoint=f"inproc://{name}-replay", context=context, **kwargs
    )


def _subscribe(context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def _replay(context, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answer = []
    try:
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b"")
                return answer
            answer.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


def test_publisher_frames_sequence_heartbeats_and_replay(context):
    publisher = _publisher(context, "pub", topic="kv", heartbeat_s=0.05)
    publisher.start()
    sub = _subscribe(context, publisher.endpoint, b"kv")
    try:
        # Idle: heartbeats, empty batches, numbered.
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        assert decode_batch(payload).events == ()
        first = int.from_bytes(seq, "big")
        h = _chain(list(range(8)))
        publisher.blocks_stored(h, None, list(range(8)), BS)
        publisher.blocks_removed([h[1]])
        publisher.blocks_removed([h[0]])
        publisher.all_blocks_cleared()
        events = []
        seqs = []
        while len(events) < 3:
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            events.extend(decode_batch(payload).events)
        assert seqs == list(range(first + 1, first + 1 + len(seqs)))
        assert events == [
            BlockStored(tuple(h), None, tuple(range(8)), BS, group_idx=0, locality="LOCAL"),
            # consecutive removals merged
            BlockRemoved((h[1], h[0]), group_idx=0, locality="LOCAL"),
            AllBlocksCleared(),
        ]
        replayed = _replay(context, publisher.replay_endpoint, first + 1)
        assert [seq for _, seq, _ in replayed][: len(seqs)] == seqs
        assert {topic for topic, _, _ in replayed} == {b"kv"}
        assert [e for _, _, p in replayed for e in decode_batch(p).events][:3] == events
        assert _replay(context, publisher.replay_endpoint, 10**9) == []
    finally:
        sub.close()
        publisher.close()


def _next_events(sub: zmq.Socket, heartbeats_after: int = 0) -> int:
    """The sequence number of the next batch with events; then waits for some heartbeats."""
    while True:
        _, seq, payload = sub.recv_multipart()
        if decode_batch(payload).events:
            break
    seen = 0
    while seen < heartbeats_after:
        _, _, payload = sub.recv_multipart()
        seen += not decode_batch(payload).events
    return int.from_bytes(seq, "big")


def test_replay_keeps_the_last_buffer_steps_batches_and_every_heartbeat_between(context):
    publisher = _publisher(context, "short", buffer_steps=3, heartbeat_s=0.005)
    publisher.start()
    sub = _subscribe(context, publisher.endpoint)
    try:
        sub.recv_multipart()  # subscribed
        batches = []
        for _ in range(4):
            publisher.all_blocks_cleared()
            batches.append(_next_events(sub, heartbeats_after=3))
        replayed = _replay(context, publisher.replay_endpoint, 0)
        seqs = [seq for _, seq, _ in replayed]
        assert seqs[0] > 0 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        with_events = [seq for _, seq, p in replayed if decode_batch(p).events]
        assert with_events == batches[1:]  # the oldest batch is gone
        assert len(seqs) > 2 * 3 + 1  # heartbeat runs replayed message by message
        # A long idle spell pushes no batch of events out.
        _, seq, _ = sub.recv_multipart()
        while int.from_bytes(sub.recv_multipart()[1], "big") < int.from_bytes(seq, "big") + 30:
            pass
        again = _replay(context, publisher.replay_endpoint, 0)
        assert [seq for _, seq, p in again if decode_batch(p).events] == batches[1:]
    finally:
        sub.close()
        publisher.close()


def test_a_full_queue_drops_events_and_tells_consumers_to_forget(context):
    publisher = _publisher(context, "full", max_queued_events=2, heartbeat_s=60)
    h = _chain(list(range(12)))
    # Not started yet: nothing drains the queue, so the third and fourth events are dropped
    # without the caller (the engine thread) waiting.
    publisher.blocks_stored(h[:1], None, list(range(4)), BS)
    publisher.blocks_stored(h[1:2], h[0], list(range(4, 8)), BS)
    publisher.blocks_removed(h[:1])
    publisher.blocks_stored(h[2:], h[1], list(range(8, 12)), BS)
    assert publisher.num_dropped == 2
    publisher.start()
    try:
        replayed = wait_until(
            lambda: _replay(context, publisher.replay_endpoint, 0), "the first batch"
        )
        payload = replayed[0][2]
        events = decode_batch(payload).events
        assert events[:2] == (
            BlockStored(tuple(h[:1]), None, (0, 1, 2, 3), BS, group_idx=0, locality="LOCAL"),
            BlockStored(tuple(h[1:2]), h[0], (4, 5, 6, 7), BS, group_idx=0, locality="LOCAL"),
        )
        assert events[-1] == AllBlocksCleared()
    finally:
        publisher.close()


def test_bind_failure_is_raised_by_start(context):
    first = _publisher(context, "taken")
    first.start()
    try:
        with pytest.raises(zmq.ZMQError):
            _publisher(context, "taken").start()
    finally:
        first.close()


def test_settings_flags_and_ready_line_keys():
    from kvtransfer.serve.settings import SettingsError, load_settings

    settings = load_settings(
        "prefill",
        [
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            "kv@p0",
        ],
        environ={},
    )
    assert settings.kv_events_endpoint == "tcp://127.0.0.1:0"
    assert settings.kv_events_topic == "kv@p0"
    assert load_settings("decode", [], environ={}).kv_events_endpoint is None  # off by default
    with pytest.raises(SettingsError, match="--kv-events-endpoint"):
        load_settings("decode", ["--kv-events-endpoint", "127.0.0.1:5557"], environ={})
    with pytest.raises(SettingsError, match="needs --kv-events-endpoint"):
        load_settings("decode", ["--kv-events-replay-endpoint", "tcp://*:1"], environ={})
