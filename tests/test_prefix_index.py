"""The router's prefix index: exact prefix counts from events (any engine's hashes), removals,
clears, what is left out, the approximate set (LRU), and which set answers for an instance."""

from __future__ import annotations

import random

import pytest
from engine_helpers.scheduler_helpers import make_request

from kvtransfer.engine.scheduler.block_manager import BlockManager
from kvtransfer.router.routing.prefix_index import PrefixIndex, block_keys
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
        {"locality": "REMOTE"},  # vLLM 0.33: a tier held elsewhere (remote storage)
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


def test_a_local_block_with_vllm_0_33s_fields_is_indexed():
    index = _index("a")
    fields = {"locality": "LOCAL", "kv_cache_spec_kind": "full_attention", "session_id": "s"}
    index.apply("a", [_stored(P, 0, [b"a0", b"a1"], **fields)])
    assert index.match(P) == {"a": 2}
    index.apply("a", [BlockRemoved((b"a1",), locality="LOCAL")])
    assert index.match(P) == {"a": 1}


def test_events_hashed_with_lookahead_tokens_make_the_instance_approximate():
    # The engine's block 0 hash covers tokens 8 and 9 too: a prompt diverging there misses in
    # the engine, so keying the block by its own tokens would claim a hit it does not give.
    index = _index("a")
    index.observe("a", Q)
    index.apply("a", [_stored(P, 0, [b"a0"], lookahead_token_ids=((9, 10),))])
    assert index.mode("a") == "approximate"
    assert "lookahead" in (index.stats()[0].unusable or "")
    assert index.match(P) == {"a": 2}  # the 2 blocks Q shares with P, from the approximate set


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
    index.observe("b", Q, pick="q")
    index.remove_instance("a")
    # b's events are live: its precise set answers, with Q pending (2 blocks shared with P).
    assert index.match(P) == {"b": 2}
    index.pick_ended("b", "q")
    assert index.match(P) == {"b": 1}
    index.observe("b", Q, pick="q2")  # pending again: dropped with the events below
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
    # What the index computes in C: each block's key hashes the previous key and its tokens.
    key, expected = 0, []
    for start in range(0, len(P) - BS + 1, BS):
        key = hash((key, *P[start : start + BS]))
        expected.append(key)
    assert block_keys(P, BS) == expected
    long = tuple(range(10_000))
    assert block_keys(long, 16)[-1] == _reference_keys(long, 16)[-1]
    keys = block_keys(P, BS)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(Q, BS)[:2] == keys[:2] and block_keys(Q, BS)[2] != keys[2]
    # Equal block contents after different prefixes get different keys.
    assert block_keys((9, 9, 9, 9, 1, 2, 3, 4), BS)[1] != block_keys((1, 2, 3, 4), BS)[0]


# ---------------------------------------------------------------------- pending picks


def _pending(index: PrefixIndex, address: str) -> int:
    return next(s.pending_blocks for s in index.stats() if s.address == address)


def test_a_pick_counts_where_events_are_live_until_they_store_its_blocks():
    index = _index("a", "b")
    assert index.match(P) == {}
    index.observe("a", P, pick="r1")  # routed there; the engine has not announced it yet
    assert index.mode("a") == "precise"
    assert index.match(P) == {"a": 3} and index.match(Q) == {"a": 2}
    assert _pending(index, "a") == 3
    # The engine stores the first two blocks: confirmed, no longer pending; the third still is.
    index.apply("a", [_stored(P, 0, [b"a0", b"a1"])])
    assert _pending(index, "a") == 1 and index.match(P) == {"a": 3}
    index.apply("a", [_stored(P, 2, [b"a2"], parent=b"a1")])
    assert _pending(index, "a") == 0 and index.stats()[0].precise_blocks == 3
    # From here the events alone answer: a removal is not covered up by the old pick.
    index.apply("a", [BlockRemoved((b"a2",))])
    assert index.match(P) == {"a": 2}
    index.pick_ended("a", "r1")  # ended after its blocks were confirmed: nothing to drop
    assert index.match(P) == {"a": 2}


def test_pending_picks_expire_after_their_ttl():
    clock = Clock()
    index = _index("a", clock=clock, pending_ttl_s=2.0)
    index.observe("a", P, pick="r1")
    clock.now += 1.0
    index.observe("a", Q, pick="r2")
    clock.now += 0.9
    assert index.match(P) == {"a": 3}
    clock.now += 0.2  # r1 is 2.1 s old: its own block (P's third) goes, Q's two stay r2's
    assert index.match(P) == {"a": 2} and index.match(Q) == {"a": 3}
    assert _pending(index, "a") == 3
    clock.now += 1.0
    index.message_received("a")  # events still flow (else the approximate set answers)
    assert index.match(Q) == {} and _pending(index, "a") == 0
    # 0: no pending picks at all (events alone, as before).
    off = _index("a", pending_ttl_s=0)
    off.observe("a", P, pick="r1")
    assert off.match(P) == {} and _pending(off, "a") == 0
    with pytest.raises(ValueError, match="pending_ttl_s"):
        PrefixIndex(pending_ttl_s=-1)


def test_all_blocks_cleared_a_restart_or_lost_events_drop_pending_picks():
    index = _index("a")
    for how in ("cleared", "forget", "clear_precise", "detach"):
        index.attach_events("a")
        index.events_synced("a", True)
        index.observe("a", P, pick=how)
        assert index.match(P) == {"a": 3}, how
        if how == "cleared":
            index.apply("a", [AllBlocksCleared()])
        elif how == "forget":
            index.forget("a")  # the subscriber saw the publisher restart
        elif how == "clear_precise":
            index.clear_precise("a")
        else:
            index.detach_events("a")
            index.forget("a")  # (its approximate set would answer now)
        assert _pending(index, "a") == 0, how
        index.attach_events("a")
        index.events_synced("a", True)
        assert index.match(P) == {}, how
    assert index._groups[BS].precise == index._groups[BS].pending == {}


def test_an_ended_or_retried_pick_drops_only_its_own_claims():
    index = _index("a", "b")
    index.observe("a", P, pick="r1")
    index.observe("a", Q, pick="r2")  # shares P's first two blocks
    index.pick_ended("b", "r1")  # not where r1 runs: nothing happens
    assert index.match(P) == {"a": 3}
    index.pick_ended("a", "r1")
    assert index.match(P) == {"a": 2} and index.match(Q) == {"a": 3}  # r2's still count
    # r2 picked again elsewhere: its try on a failed.
    index.observe("b", Q, pick="r2")
    assert index.match(Q) == {"b": 3}
    index.picks_ended("b")  # nothing of the router runs on b any more
    assert index.match(Q) == {}
    assert index._groups[BS].pending == {} and index._pending.live == {}


def test_a_claim_made_after_a_block_was_stored_and_dropped_outlives_older_picks():
    index = _index("a")
    index.observe("a", P, pick="old")
    index.apply("a", [_stored(P, 0, [b"a0", b"a1", b"a2"])])  # confirmed...
    index.apply("a", [BlockRemoved((b"a2",))])  # ...then evicted
    index.observe("a", P, pick="new")  # pending again, for the new pick only
    index.pick_ended("a", "old")
    assert index.match(P) == {"a": 3}
    index.pick_ended("a", "new")
    assert index.match(P) == {"a": 2}


def test_pending_blocks_are_not_claimed_where_events_are_not_live():
    clock = Clock()
    index = PrefixIndex(default_block_size=BS, clock=clock)
    index.add_instance("a")
    index.observe("a", P, pick="r1")  # no events: the approximate set learns it, no pick
    assert _pending(index, "a") == 0 and index.match(P) == {"a": 3}
    index.attach_events("a")
    index.events_synced("a", True)
    index.observe("a", Q, pick="r2")
    clock.now += index.max_event_lag_s + 0.1  # events lag: the approximate set answers
    index.observe("a", P, pick="r3")
    assert index.mode("a") == "approximate" and index.match(P) == {"a": 3}


def _reference_keys(tokens, block_size: int) -> list[int]:
    key, keys = 0, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, *tokens[start : start + block_size]))
        keys.append(key)
    return keys


def _reference_match(index: PrefixIndex, tokens) -> dict[str, int]:
    """What `match` answers, block by block and instance by instance (the old walk)."""
    result = {}
    for address in index.addresses:
        inst = index._instances[address]
        if index.mode(address) == "precise":
            held = set(inst.precise_refs) | set(inst.pending)
        else:
            held = set(inst.approx)
        count = 0
        for key in _reference_keys(tokens, inst.group.block_size):
            if key not in held:
                break
            count += 1
        if count:
            result[address] = count
    return result


@pytest.mark.parametrize("pending_ttl_s", [3.0, 0.0])
def test_match_equals_a_block_by_block_walk_on_random_prefixes(pending_ttl_s):
    """Holes included (removals, LRU evictions of leading blocks, mixed modes, two block sizes):
    the walk in rounds gives what checking every block of every instance gives."""
    rng = random.Random(7)
    clock = Clock()
    index = PrefixIndex(
        default_block_size=BS, approx_capacity_blocks=60, pending_ttl_s=pending_ttl_s, clock=clock
    )
    addresses = [f"i{n}" for n in range(6)]
    for n, address in enumerate(addresses):
        index.add_instance(address, block_size=BS if n < 5 else 2 * BS)
        if n % 3:
            index.attach_events(address)
            index.events_synced(address, True)
    stems = [tuple(rng.randrange(5) for _ in range(rng.randrange(4, 40))) for _ in range(8)]
    prompts = [s + tuple(rng.randrange(5) for _ in range(rng.randrange(0, 200))) for s in stems]
    prompts += [p[: rng.randrange(len(p) + 1)] for p in prompts]
    hashes = iter(range(10**9))
    for step in range(400):
        address = rng.choice(addresses)
        prompt = rng.choice(prompts)
        bs = index.block_size(address)
        roll = rng.random()
        if roll < 0.3:
            count = len(prompt) // bs
            index.apply(address, [BlockStored(tuple(next(hashes) for _ in range(count)), None,
                                              prompt[: count * bs], bs)])  # fmt: skip
        elif roll < 0.45:
            engine = index._instances[address].engine_keys
            if engine:
                index.apply(address, [BlockRemoved(tuple(rng.sample(list(engine), 1)))])
        elif roll < 0.8:
            index.observe(address, prompt, pick=f"r{rng.randrange(30)}")
        elif roll < 0.85:
            index.pick_ended(address, f"r{rng.randrange(30)}")
        elif roll < 0.9:
            clock.now += rng.choice((0.5, 3.5))  # picks expire; some events lag
            index.message_received(address)
        for probe in rng.sample(prompts, 5):
            clock.now += 0.02  # past the reuse of the last look-up
            assert index.match(probe) == _reference_match(index, probe), (step, probe)
            assert index.match(list(probe)) == _reference_match(index, probe)


def test_a_chain_that_repeats_a_key_neither_raises_nor_leaves_keys(monkeypatch):
    """Keys are a non-cryptographic hash: a crafted prompt could make its chain come back to
    a key it had (a collision). Claims and their ends must not raise on it."""
    index = _index("a", "b")

    class Repeating:
        total = 4

        def upto(self, count):
            return [11, 22, 11, 22]

    monkeypatch.setattr(
        "kvtransfer.router.routing.prefix_index.index.chain_of", lambda *a, **k: Repeating()
    )
    for pick in ("r1", "r2"):
        index.observe("a", P, pick=pick)
        index.observe("b", P, pick=pick + "b")
    index.pick_ended("a", "r1")
    index.pick_ended("a", "r2")
    index.picks_ended("b")
    assert index._groups[BS].pending == {} and index._pending.live == {}
    assert all(s.pending_blocks == 0 for s in index.stats())
