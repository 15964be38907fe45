"""The ``cache_aware`` policy: the longest cached prefix wins, within the load guard (a hot
prefix never puts more than ``balance_share`` x the fair share on one instance), KV usage, the
least-loaded fallback and its ties, what it learns from its own picks, and the uncached-token
estimate conditional disaggregation uses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.routing.cache_policy import (
    CacheAwarePolicy,
    CacheAwareSettings,
    tie_rank,
)
from kvtransfer.router.routing.policy import InstanceLoad, RouteContext, create_policy, load_score
from kvtransfer.router.routing.prefix_index import PrefixIndex
from kvtransfer.serve.kv_events import BlockStored

pytestmark = pytest.mark.unit

BS = 4


@dataclass(eq=False)
class Instance:
    address: str
    in_flight: int = 0
    load: InstanceLoad | None = None


def _route(tokens, rid: str = "r") -> RouteContext:
    return RouteContext(rid, None if tokens is None else tuple(tokens))


def _policy(role: str = "prefill", **settings) -> CacheAwarePolicy:
    return CacheAwarePolicy(
        PrefixIndex(default_block_size=BS), role=role, settings=CacheAwareSettings(**settings)
    )


def _cache(policy: CacheAwarePolicy, address: str, tokens, blocks: int) -> None:
    """The instance's events say it holds the first ``blocks`` blocks of ``tokens``."""
    index = policy.index
    if address not in index.addresses:
        index.add_instance(address)
        index.attach_events(address)
        index.events_synced(address, True)
    hashes = tuple(f"{address}/{tokens[:4]}/{i}".encode() for i in range(blocks))
    index.apply(address, [BlockStored(hashes, None, tuple(tokens[: blocks * BS]), BS)])


def _pick(policy, instances, tokens, rid="r"):
    """What the fleet does: choose, count it in flight, observe."""
    route = _route(tokens, rid)
    chosen = policy.choose(instances, route)
    chosen.in_flight += 1
    policy.observe(chosen, route)
    return chosen


PROMPT = tuple(range(1, 42))  # 10 full blocks


def test_the_longest_cached_prefix_wins_then_the_lower_load():
    policy = _policy()
    a, b, c = Instance("a"), Instance("b", in_flight=1), Instance("c", in_flight=2)
    _cache(policy, "a", PROMPT, 2)
    _cache(policy, "b", PROMPT, 6)
    _cache(policy, "c", PROMPT, 6)
    assert policy.choose([a, b, c], _route(PROMPT)) is b
    assert policy.last_decision.reason == "cache" and policy.last_decision.cached_blocks == 6


def test_a_hot_prefix_never_puts_more_than_the_share_on_one_instance():
    policy = _policy(balance_share=1.5, balance_floor=2)
    fleet = [Instance(f"i{n}") for n in range(4)]
    _cache(policy, "i0", PROMPT, 10)
    placed_by_cache = 0
    for n in range(60):
        chosen = _pick(policy, fleet, PROMPT, f"r{n}")
        total = sum(i.in_flight for i in fleet)
        if policy.last_decision.reason == "cache":
            placed_by_cache += 1
            assert chosen.in_flight <= max(1.5 * total / len(fleet), 2), [
                i.in_flight for i in fleet
            ]
    loads = [i.in_flight for i in fleet]
    # Affinity kept as far as the guard allows: the holder carries its whole allowance...
    assert loads[0] == max(loads) and loads[0] <= 1.5 * 60 / 4
    # ...and the overflow spread over the others (which learned the prefix from it).
    assert min(loads) >= 60 / 4 / 2
    assert placed_by_cache > 0 and policy.decisions["balance"] > 0


def test_without_the_guard_the_hot_prefix_would_all_go_to_one_instance():
    policy = _policy(balance_share=1000, balance_floor=1000)
    fleet = [Instance(f"i{n}") for n in range(4)]
    _cache(policy, "i0", PROMPT, 10)
    for n in range(40):
        _pick(policy, fleet, PROMPT, f"r{n}")
    assert [i.in_flight for i in fleet] == [40, 0, 0, 0]


def test_other_routers_load_from_reports_counts_in_the_guard():
    policy = _policy(balance_share=1.5, balance_floor=1)
    busy = Instance(
        "busy", load=InstanceLoad(running=8, waiting=4, kv_blocks_used=1, kv_blocks_total=10)
    )
    idle = Instance("idle")
    _cache(policy, "busy", PROMPT, 10)
    assert load_score(busy) == 12
    assert policy.choose([busy, idle], _route(PROMPT)) is idle
    assert policy.last_decision.reason == "balance"


def test_an_instance_whose_kv_cache_is_nearly_full_is_not_preferred_for_its_prefix():
    policy = _policy(max_kv_usage=0.9)
    full = Instance("full", load=InstanceLoad(0, 0, kv_blocks_used=95, kv_blocks_total=100))
    other = Instance("other", load=InstanceLoad(0, 0, kv_blocks_used=10, kv_blocks_total=100))
    _cache(policy, "full", PROMPT, 10)
    _cache(policy, "other", PROMPT, 3)
    assert policy.choose([full, other], _route(PROMPT)) is other
    assert policy.last_decision.cached_blocks == 3


def test_nothing_cached_goes_to_the_least_loaded_and_ties_stay_with_a_prefix():
    policy = _policy()
    fleet = [Instance(f"i{n}") for n in range(4)]
    fleet[2].in_flight = 0
    for instance in (fleet[0], fleet[1], fleet[3]):
        instance.in_flight = 1
    assert policy.choose(fleet, _route(PROMPT)) is fleet[2]
    assert policy.last_decision.reason == "least_load"
    # All tied: one prompt keeps its instance; many distinct prompts spread.
    idle = [Instance(f"j{n}") for n in range(4)]
    first = policy.choose(idle, _route(PROMPT))
    assert all(policy.choose(idle, _route(PROMPT)) is first for _ in range(5))
    chosen = {policy.choose(idle, _route(range(100 * n, 100 * n + 9))).address for n in range(40)}
    assert len(chosen) >= 3


def test_a_tie_between_block_sizes_is_broken_alike_whatever_the_fleets_order():
    # Two router replicas may list a role's instances in different orders; with the first
    # block as long as the first tied one's block size, the one listing the 8-token instance
    # first hashed another prefix and sent the prompt elsewhere.
    small, large = Instance("10.0.0.1:8100"), Instance("10.0.0.2:8100")
    picks = []
    for fleet in ([small, large], [large, small]):
        policy = _policy()
        policy.index.add_instance(small.address, block_size=4)
        policy.index.add_instance(large.address, block_size=8)
        picks.append(policy.choose(fleet, _route(PROMPT)).address)
    # The smallest block size (4) decides: 10.0.0.2 ranks higher for PROMPT[:4], 10.0.0.1
    # for PROMPT[:8].
    assert picks == ["10.0.0.2:8100", "10.0.0.2:8100"]


def test_the_tie_rank_of_a_known_block_stays_what_it_was():
    # Router replicas of two versions run side by side during a rolling upgrade: a change of
    # this value (another hash, another canonical form) sends a prefix to different instances
    # from each version, and each computes it. Change it only knowingly.
    assert tie_rank((1, 2, 3, 4), "10.0.0.1:8100") == 4706019938515969173
    assert tie_rank((1, 2, 3, 4), "10.0.0.2:8100") == 9813250235339990789


def test_unknown_prompts_go_round_the_least_loaded_in_turn():
    policy = _policy()
    fleet = [Instance(f"i{n}") for n in range(3)]
    picks = [policy.choose(fleet, _route(None)).address for _ in range(6)]
    assert picks == ["i0", "i1", "i2", "i0", "i1", "i2"]


def test_it_learns_where_it_sent_a_prompt():
    policy = _policy()
    fleet = [Instance("a"), Instance("b")]
    first = _pick(policy, fleet, PROMPT)
    first.in_flight = 0  # finished
    other = next(i for i in fleet if i is not first)
    other.in_flight = 0
    # Tied loads, but now the first holds the prompt (approximately): it wins by cache.
    longer = (*PROMPT, 7, 7, 7)
    assert policy.choose(fleet, _route(longer)) is first
    assert policy.last_decision.reason == "cache"
    assert policy.last_decision.cached_blocks == 10


def test_decode_role_prefers_the_instance_holding_most_of_the_prefix():
    policy = _policy(role="decode")
    d1, d2 = Instance("d1"), Instance("d2", in_flight=2)
    _cache(policy, "d1", PROMPT, 2)
    _cache(policy, "d2", PROMPT, 8)
    assert policy.choose([d1, d2], _route(PROMPT)) is d2
    # It would pull 41 - 32 = 9 tokens' worth of blocks, compute the rest: 9 uncached.
    assert policy.uncached_tokens([d1, d2], _route(PROMPT)) == len(PROMPT) - 8 * BS
    assert policy.candidate_uncached_tokens(d1, PROMPT) == len(PROMPT) - 2 * BS


def test_uncached_tokens_count_a_hit_as_the_engines_do_and_whole_prompt_when_unknown():
    policy = _policy()
    a = Instance("a")
    # Exactly 10 blocks, all cached: the last token must still be computed, and engines reuse
    # whole blocks only, so the last block is computed again (what they report as cached).
    exact = PROMPT[:40]
    _cache(policy, "a", exact, 10)
    assert policy.uncached_tokens([a], _route(exact)) == BS
    # One token more: all 10 blocks are used, the new token alone is computed.
    assert policy.uncached_tokens([a], _route(PROMPT[:41])) == 1
    assert policy.uncached_tokens([Instance("b")], _route(PROMPT)) == len(PROMPT)
    assert policy.uncached_tokens([a], _route(None)) == 0
    assert policy.uncached_tokens([], _route(PROMPT)) == len(PROMPT)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="balance_share"):
        CacheAwareSettings(balance_share=0.5)
    with pytest.raises(ValueError, match="max_kv_usage"):
        CacheAwareSettings(max_kv_usage=0)


def test_the_router_builds_it_by_name_with_its_own_index_per_role():
    config = RouterConfig(prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), policy="cache_aware")
    prefill = create_policy("cache_aware", "prefill", config)
    decode = create_policy("cache_aware", "decode", config)
    assert isinstance(prefill, CacheAwarePolicy) and prefill.name == "cache_aware"
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert prefill.index is not decode.index


# ---------------------------------------------------------------------- pending picks


def _live(policy: CacheAwarePolicy, *addresses: str) -> None:
    """The instances' events are attached and in sync (nothing stored yet)."""
    for address in addresses:
        policy.index.add_instance(address)
        policy.index.attach_events(address)
        policy.index.events_synced(address, True)


NEW = tuple(range(500, 500 + 40 * BS))  # a new 40-block prefix


def test_a_burst_on_a_new_prefix_goes_where_the_first_went_until_the_guard():
    policy = _policy(balance_share=1.5, balance_floor=4)
    fleet = [Instance(f"p{n}") for n in range(4)]
    _live(policy, *(i.address for i in fleet))
    # 8 requests sharing the prefix within a few ms: no engine has announced it yet.
    chosen = [_pick(policy, fleet, (*NEW, n, n, n, n), f"r{n}") for n in range(8)]
    first = chosen[0]
    assert chosen[:4] == [first] * 4  # the guard's floor: 4 on one instance
    assert [policy.index.mode(i.address) for i in fleet] == ["precise"] * 4
    # The guard then sends the 5th to the least loaded, which takes the rest of the burst.
    second = chosen[4]
    assert second is not first and chosen[4:] == [second] * 4
    assert sorted(i.in_flight for i in fleet) == [0, 0, 4, 4]
    assert policy.decisions["cache"] == 6 and policy.decisions["balance"] == 1


def test_without_the_guard_the_whole_burst_shares_one_prefill():
    policy = _policy(balance_share=1000, balance_floor=1000)
    fleet = [Instance(f"p{n}") for n in range(4)]
    _live(policy, *(i.address for i in fleet))
    chosen = {_pick(policy, fleet, NEW, f"r{n}").address for n in range(20)}
    assert len(chosen) == 1


def test_events_storing_the_prefix_take_over_from_the_pick():
    policy = _policy()
    fleet = [Instance("a"), Instance("b")]
    _live(policy, "a", "b")
    first = _pick(policy, fleet, NEW, "r0")
    _cache(policy, first.address, NEW, 40)  # the engine announces it
    stats = {s.address: s for s in policy.index.stats()}
    assert stats[first.address].pending_blocks == 0
    assert stats[first.address].precise_blocks == 40
    first.in_flight = 0  # done: its events hold the prefix, the pick no longer matters
    assert _pick(policy, fleet, NEW, "r1") is first
    assert policy.last_decision.reason == "cache" and policy.last_decision.cached_blocks == 40


def test_a_pick_that_ended_or_failed_no_longer_counts():
    policy = _policy()
    fleet = [Instance("a"), Instance("b")]
    _live(policy, "a", "b")
    first = _pick(policy, fleet, NEW, "r0")
    other = next(i for i in fleet if i is not first)
    assert policy.index.match(NEW) == {first.address: 40}
    # It failed before its engine stored anything: the router tries another instance.
    first.in_flight -= 1
    retry = policy.choose([other], _route(NEW, "r0"))
    other.in_flight += 1
    policy.observe(retry, _route(NEW, "r0"))
    assert policy.index.match(NEW) == {other.address: 40}
    # It ended there without its events showing the prefix (none will now).
    policy.pick_ended(other, _route(NEW, "r0"))
    assert policy.index.match(NEW) == {}
    # The same, learned from the candidates: nothing of the router runs on an instance.
    _pick(policy, fleet, NEW, "r1")
    for instance in fleet:
        instance.in_flight = 0
    policy.choose(fleet, _route(PROMPT, "r2"))
    assert policy.index.match(NEW) == {}
    assert [s.pending_picks for s in policy.index.stats()] == [0, 0]
