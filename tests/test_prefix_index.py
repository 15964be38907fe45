"""The router's prefix index: exact prefix counts from events (any engine's hashes), removals,
clears, what is left out, the approximate set (LRU), and which set answers for an instance."""

from __future__ import annotations

import random

import pytest
from engine_helpers.scheduler_helpers import make_request

from kvtransfer.engine.scheduler.block_manager import BlockManager
from kvtransfer.router.prefix_index import PrefixIndex, block_keys
from kvtransfer.serve.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.unit

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _index(*addresses: str, clock: Clock | None = None, **kwargs) -> PrefixIndex:
    index = PrefixIndex(default_block_size=BS, clock=clock or Clock(), **kwargs)
    for address in addresses:
        index.add_instance(address)
        index.attach_events(address)
        index.events_synced(address, True)
    return index


def _stored(tokens, first_block: int, hashes, parent=None, **fields) -> BlockStored:
    """Blocks ``first_block``... of ``tokens`` (one hash each), as an engine reports them."""
    start = first_block * BS
    return BlockStored(
        tuple(hashes), parent, tuple(tokens[start : start + len(hashes) * BS]), BS, **fields
    )


P = tuple(range(1, 15))  # 3 full blocks and 2 tokens
Q = (*P[:8], 90, 91, 92, 93, 94)  # shares 2 blocks with P


def test_match_counts_leading_full_blocks_per_instance():
    index = _index("a", "b")
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])
    # b holds P's first block, then Q's third under another engine's (integer) hashes.
    index.apply("b", [_stored(Q, 0, [10, 11]), _stored(Q, 2, [12], parent=11)])
    assert index.match(P) == {"a": 3, "b": 2}
    assert index.match(Q) == {"a": 2, "b": 3}
    assert index.match(P[:11]) == {"a": 2, "b": 2}  # the third block is not full
    assert index.match((*P[:4], 0, *P[5:])) == {"a": 1, "b": 1}  # differs inside block 1
    assert index.match((0, *P[1:])) == {}
    assert index.match(P[:3]) == {}
    assert index.cached_blocks("b", list(Q)) == 3  # a list works too


def test_removal_cuts_the_prefix_and_a_restore_brings_it_back():
    index = _index("a")
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])
    index.apply("a", [BlockRemoved((b"a1",))])
    assert index.match(P) == {"a": 1}  # block 2 is still cached but unreachable
    index.apply("a", [_stored(P, 1, [b"a1"], parent=b"a0")])
    assert index.match(P) == {"a": 3}
    index.apply("a", [BlockRemoved((b"a0", b"unknown"))])
    assert index.match(P) == {}
    index.apply("a", [AllBlocksCleared(), _stored(Q, 0, [b"q0"])])
    assert index.match(P) == {"a": 1}
    assert index.stats()[0].precise_blocks == 1  # the clear dropped the unreachable ones


def test_a_block_whose_parent_is_unknown_is_left_out():
    index = _index("a")
    index.apply("a", [_stored(P, 1, [b"a1", b"a2"], parent=b"never-seen")])
    assert index.match(P) == {}
    assert index.stats()[0].skipped_events == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"lora_id": 3},
        {"lora_name": "adapter"},
        {"medium": "CPU"},
        {"group_idx": 1},
    ],
)
def test_blocks_keyed_by_more_than_tokens_or_elsewhere_are_left_out(fields):
    index = _index("a")
    index.apply("a", [_stored(P, 0, [b"a0", b"a1"], **fields)])
    assert index.match(P) == {}
    # ...and so is their removal: it cannot take a key it never gave.
    index.apply("a", [_stored(P, 0, [b"a0"])])
    index.apply("a", [BlockRemoved((b"a0",), medium="CPU")])
    assert index.match(P) == {"a": 1}


def test_extra_keys_stop_the_chain_at_the_first_salted_block():
    index = _index("a")
    stored = _stored(P, 0, [b"a0", b"a1", b"a2"], extra_keys=(None, ("salt",), None))
    index.apply("a", [stored])
    assert index.match(P) == {"a": 1}


def test_a_batch_that_is_not_one_block_per_hash_is_left_out():
    index = _index("a")
    index.apply("a", [BlockStored((b"a0",), None, P[:8], BS)])  # 8 tokens, 1 hash
    assert index.match(P) == {}


def test_events_of_another_block_size_make_the_instance_approximate():
    index = _index("a")
    index.observe("a", P)
    index.apply("a", [BlockStored((b"x",), None, P[:8], 8)])
    assert index.mode("a") == "approximate"
    assert "block_size 8" in (index.stats()[0].unusable or "")
    assert index.match(P) == {"a": 3}  # from the approximate set


def test_instances_of_two_block_sizes_are_matched_each_with_its_own():
    index = _index("a")
    index.add_instance("big", block_size=8)
    index.attach_events("big")
    index.events_synced("big", True)
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])
    index.apply("big", [BlockStored((b"b0",), None, P[:8], 8)])
    assert index.match(P) == {"a": 3, "big": 1}
    assert index.block_size("big") == 8 and index.block_size("unknown") == BS


def test_precise_set_equals_a_real_block_managers_cache():
    """Random prompts over shared prefixes through a small pool (evictions, duplicates): after
    every request, the index's count for any prompt is what the engine's cache holds."""
    rng = random.Random(7)
    blocks = BlockManager(num_blocks=24, block_size=BS)
    index = _index("engine")
    batch: list = []

    class Sink:
        def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size):
            batch.append(BlockStored(tuple(block_hashes), parent_hash, tuple(token_ids), BS))

        def blocks_removed(self, block_hashes):
            batch.append(BlockRemoved(tuple(block_hashes)))

        def all_blocks_cleared(self):
            batch.append(AllBlocksCleared())

    blocks.event_sink = Sink()
    stems = [tuple(rng.randrange(50) for _ in range(12)) for _ in range(4)]
    prompts = [s + tuple(rng.randrange(50) for _ in range(rng.randrange(1, 14))) for s in stems]
    prompts += [tuple(rng.randrange(50) for _ in range(rng.randrange(4, 20))) for _ in range(6)]

    def engine_holds(prompt) -> int:
        # One token more, so the engine's look-up may cover every full block of ``prompt``;
        # freeing the probe drops the hashes the engine memoised for its id.
        hits, _ = blocks.get_computed_blocks(make_request("probe", [*prompt, 0]))
        blocks.free("probe")
        return len(hits)

    running: list[str] = []
    for step in range(300):
        prompt = rng.choice(prompts)
        rid = f"r{step}"
        request = make_request(rid, prompt)
        hits, num_hit = blocks.get_computed_blocks(request)
        if blocks.allocate_slots(request, len(prompt) - num_hit, hits) is not None:
            request.num_computed_tokens = len(prompt)
            blocks.cache_full_blocks(request, len(prompt))
            running.append(rid)
        while running and (len(running) > 3 or rng.random() < 0.5):
            blocks.free(running.pop(rng.randrange(len(running))))
        if step == 150:
            blocks.reset_prefix_cache()
        index.apply("engine", batch)
        batch.clear()
        for probe in prompts:
            assert index.match(probe).get("engine", 0) == engine_holds(probe), (step, probe)
    for rid in running:
        blocks.free(rid)
    blocks.check_no_leaks()


def test_approximate_set_learns_routed_prompts_and_evicts_the_least_recent():
    index = PrefixIndex(default_block_size=BS, approx_capacity_blocks=5, clock=Clock())
    index.observe("a", P)  # 3 blocks
    assert index.mode("a") == "approximate"
    assert index.match(P) == {"a": 3}
    index.observe("a", Q)  # shares 2 (refreshed), adds 1: 4 in all
    index.observe("a", P)  # P's blocks most recent again
    other = tuple(range(200, 208))
    index.observe("a", other)  # 2 more: 6 > 5, Q's third block (least recent) goes
    assert index.match(P) == {"a": 3}
    assert index.match(Q) == {"a": 2}
    assert index.match(other) == {"a": 2}
    assert index.stats()[0].approx_blocks == 5
    index.observe("a", P[:3])  # no full block: nothing learned
    assert index.stats()[0].approx_blocks == 5


def test_which_set_answers_follows_the_events_health():
    clock = Clock()
    index = PrefixIndex(default_block_size=BS, max_event_lag_s=3.0, clock=clock)
    index.add_instance("a")
    index.observe("a", Q)  # approximate: Q
    assert index.mode("a") == "approximate"  # no events attached
    index.attach_events("a")
    assert index.mode("a") == "approximate"  # attached, not in sync yet
    index.events_synced("a", True)
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])
    index.message_received("a")
    assert index.mode("a") == "precise"
    assert index.match(Q) == {"a": 2} and index.match(P) == {"a": 3}
    # A request whose blocks the events do not show yet: they are expected.
    index.observe("a", Q)
    clock.now += 2.9
    assert index.mode("a") == "precise"
    clock.now += 0.2
    assert index.mode("a") == "approximate"  # routed 3.1 s ago, nothing heard since
    assert index.match(Q) == {"a": 3}
    index.message_received("a")
    assert index.mode("a") == "precise"
    # A request all of whose blocks are already indexed expects nothing.
    index.observe("a", P)
    clock.now += 10
    assert index.mode("a") == "precise"
    # A publisher seen sending heartbeats must not fall silent.
    index.message_received("a", heartbeat=True)
    clock.now += 3.1
    assert index.mode("a") == "approximate"
    index.message_received("a")
    index.events_synced("a", False)
    assert index.mode("a") == "approximate"
    index.events_synced("a", True)
    index.detach_events("a")
    assert index.mode("a") == "approximate" and index.stats()[0].precise_blocks == 0


def test_instances_come_and_go_without_leaving_keys_behind():
    index = _index("a", "b")
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])
    index.apply("b", [_stored(P, 0, [b"b0"])])
    index.observe("b", Q)
    index.remove_instance("a")
    assert index.match(P) == {"b": 1}  # b's events are live: its precise set answers
    index.detach_events("b")
    assert index.match(P) == {"b": 2}  # now its approximate set (Q shares 2 blocks)
    index.add_instance("c")  # takes a's slot: nothing of a's shows up as c's
    assert index.match(P) == {"b": 2}
    index.forget("b")
    assert index.match(P) == {}
    index.remove_instance("b")
    index.remove_instance("c")
    assert index.addresses == []
    assert index._groups == {}  # every key gone with its instances


def test_changing_an_instances_block_size_forgets_its_keys():
    index = _index("a")
    index.apply("a", [_stored(P, 0, [b"a0"])])
    index.add_instance("a")  # nothing given: nothing changes
    assert index.match(P) == {"a": 1}
    index.add_instance("a", block_size=8)
    assert index.match(P) == {}
    assert index.block_size("a") == 8
    assert index.stats()[0].events_attached and index.mode("a") == "precise"
    index.add_instance("a")
    assert index.block_size("a") == 8
    index.observe("a", tuple(range(100)))
    index.add_instance("a", approx_capacity_blocks=2)
    assert index.stats()[0].approx_blocks == 2


def test_block_keys_chain_from_the_root():
    assert block_keys(P, BS) == block_keys(list(P), BS)
    keys = block_keys(P, BS)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(Q, BS)[:2] == keys[:2] and block_keys(Q, BS)[2] != keys[2]
    # Equal block contents after different prefixes get different keys.
    assert block_keys((9, 9, 9, 9, 1, 2, 3, 4), BS)[1] != block_keys((1, 2, 3, 4), BS)[0]
