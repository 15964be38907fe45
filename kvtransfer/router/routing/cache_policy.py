"""``cache_aware``: send a prompt where most of its prefix is cached, within a share of the load.

`CacheAwarePolicy.choose`, for a request whose token ids are known:

1. The prefix index (`kvtransfer.router.routing.prefix_index`) tells how many leading full blocks of
   the prompt each candidate holds.
2. The load guard: with ``n`` candidates carrying ``total`` requests (`policy.load_score`: this
   router's in flight plus other routers' share from the instances' reports), a candidate may
   be preferred for its cache only if taking this request keeps it within
   ``max(balance_share * (total + 1) / n, balance_floor)`` requests, and its KV cache is used
   below ``max_kv_usage``. One hot prefix therefore never piles more than ``balance_share``
   times the fair share on one instance; the overflow goes to the least loaded, which then
   learns the prefix too.
3. Among the candidates the guard allows, the one holding the most blocks (at least
   ``min_match_blocks``) wins; ties go to the lower load, then the lower KV use.
4. Otherwise (no tokens, nothing cached, or the guard ruled the holders out) the least loaded
   candidate wins; ties go to the lower KV use, the most blocks held, then to a choice fixed by
   the prompt's first block (`tie_rank`: the same prefix lands on the same instance while loads
   tie, on every router replica alike, whatever order it lists the fleet in; different ones
   spread), or in turn when the prompt is unknown. The first block is as long as the smallest
   block size among the tied instances.

The same rule serves both roles: a prefill instance holding the prefix computes only the rest;
a decode instance holding it pulls only the blocks it lacks. `observe` teaches the index the
chosen instance (its approximate set) and, where events are live, makes the prompt's blocks
that the instance's events do not show yet *pending* there for this request: they count as
cached on it until its events store them, the request ends there, or a few seconds pass
(`PrefixIndex`), so a burst of requests on a new prefix lands where the first one went, within
the load guard, rather than being spread before any engine has announced the prefix. The
policy learns that a request ended from the candidates it is offered: one with nothing of this
router in flight runs none of its picks (`pick_ended` says it of one request, for a caller that
knows). A request picked again, the retry of a failed try, ends its previous pick.

`uncached_tokens` (the `policy.UncachedEstimator` that conditional disaggregation asks) is the
prompt tokens the instance `choose` would pick must compute (at least the last one: an engine
never serves a whole prompt from its cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvtransfer.router.names import CACHE_AWARE
from kvtransfer.router.routing.policy import Candidate, RouteContext, load_score
from kvtransfer.router.routing.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from kvtransfer.router.config import RouterConfig


@dataclass(frozen=True)
class CacheAwareSettings:
    balance_share: float = 1.5
    balance_floor: int = 4
    max_kv_usage: float = 0.95
    min_match_blocks: int = 1

    def __post_init__(self) -> None:
        if self.balance_share < 1:
            raise ValueError(f"balance_share must be >= 1, got {self.balance_share}")
        if self.balance_floor < 1 or self.min_match_blocks < 1:
            raise ValueError("balance_floor and min_match_blocks must be >= 1")
        if not 0 < self.max_kv_usage <= 1:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")


@dataclass(frozen=True)
class Decision:
    """Why `choose` picked what it picked (the last one is kept, for logs and tests)."""

    address: str
    reason: str  # "cache", "least_load" (nothing cached), "balance" (the guard overruled)
    cached_blocks: int


class CacheAwarePolicy:
    name = CACHE_AWARE

    def __init__(
        self,
        index: PrefixIndex,
        *,
        role: str,
        settings: CacheAwareSettings | None = None,
    ) -> None:
        self.index = index
        self.role = role
        self.settings = settings or CacheAwareSettings()
        self.last_decision: Decision | None = None
        self.decisions: Counter[str] = Counter()
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], route: RouteContext) -> Candidate:
        chosen, decision = self._decide(candidates, route.token_ids)
        self.last_decision = decision
        self.decisions[decision.reason] += 1
        if route.token_ids is None:
            self._turn += 1
        return chosen

    def observe(self, chosen: Candidate, route: RouteContext) -> None:
        if route.token_ids:
            self.index.observe(chosen.address, route.token_ids, pick=route.request_id)

    def pick_ended(self, chosen: Candidate, route: RouteContext) -> None:
        """The request of ``route``, picked on ``chosen``, no longer runs there (it finished
        or failed): blocks of it that the instance's events have not shown stop counting."""
        self.index.pick_ended(chosen.address, route.request_id)

    def uncached_tokens(self, candidates: Sequence[Candidate], route: RouteContext) -> int:
        tokens = route.token_ids or ()
        if not candidates or not tokens:
            return len(tokens)
        _, decision = self._decide(candidates, tokens)
        block_size = self.index.block_size(decision.address)
        return _uncached(len(tokens), decision.cached_blocks, block_size)

    def candidate_uncached_tokens(self, candidate: Candidate, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` that ``candidate`` would compute (at least 1)."""
        blocks = self.index.cached_blocks(candidate.address, token_ids)
        return _uncached(len(token_ids), blocks, self.index.block_size(candidate.address))

    def _decide(
        self, candidates: Sequence[Candidate], token_ids: Sequence[int] | None
    ) -> tuple[Candidate, Decision]:
        if not candidates:
            raise ValueError("no candidates to choose from")
        settings = self.settings
        index = self.index
        if index.has_picks:
            for candidate in candidates:
                if not candidate.in_flight:
                    # Nothing of this router runs there: every pick it made there ended, and
                    # what their engine did not announce by now is not coming.
                    index.picks_ended(candidate.address)
        loads = [load_score(c) for c in candidates]
        usages = [c.load.kv_usage if c.load is not None else 0.0 for c in candidates]
        cached = index.match(token_ids) if token_ids else {}
        blocks = [cached.get(c.address, 0) for c in candidates]
        if max(blocks) >= settings.min_match_blocks:
            fair = (sum(loads) + 1) / len(candidates)
            cap = max(settings.balance_share * fair, settings.balance_floor)
            allowed = [
                i
                for i in range(len(candidates))
                if loads[i] + 1 <= cap and usages[i] < settings.max_kv_usage
            ]
            best = max(allowed, key=lambda i: (blocks[i], -loads[i], -usages[i]), default=None)
            if best is not None and blocks[best] >= settings.min_match_blocks:
                return candidates[best], Decision(candidates[best].address, "cache", blocks[best])
            reason = "balance"
        else:
            reason = "least_load"
        lowest = min(zip(loads, usages, strict=True))
        tied = [i for i in range(len(candidates)) if (loads[i], usages[i]) == lowest]
        most = max(blocks[i] for i in tied)
        tied = [i for i in tied if blocks[i] == most]
        if len(tied) == 1:
            pick = tied[0]
        elif token_ids:
            # The smallest block size among the tied, not the first one's: replicas that list
            # the fleet in another order must hash the same prefix.
            size = min(self.index.block_size(candidates[i].address) for i in tied)
            first = token_ids[:size]
            pick = max(tied, key=lambda i: tie_rank(first, candidates[i].address))
        else:
            pick = tied[self._turn % len(tied)]
        return candidates[pick], Decision(candidates[pick].address, reason, blocks[pick])


def tie_rank(first_block: Sequence[int], address: str) -> int:
    """Where a prompt whose first block is ``first_block`` goes among tied candidates: the
    highest rank wins. Every router replica, in every run, ranks alike (Python's ``hash`` of a
    str is salted per process, ``PYTHONHASHSEED``), so replicas behind one load balancer send
    a prefix to one instance; the rank of one prefix differs from instance to instance, so
    prefixes spread."""
    # Token ids as decimal text, then the address: no two (block, address) pairs share bytes.
    canonical = ",".join(map(str, first_block)) + "@" + address
    return xxhash.xxh3_64_intdigest(canonical.encode())


def _uncached(num_tokens: int, cached_blocks: int, block_size: int) -> int:
    # As the engines (ours, vLLM) count a hit: whole blocks only, and never the prompt's last
    # token (it must be computed to sample the next one).
    usable = min(cached_blocks, max(num_tokens - 1, 0) // block_size)
    return num_tokens - usable * block_size


def create_policy(role: str, config: RouterConfig) -> CacheAwarePolicy:
    """The ``cache_aware`` policy of ``role`` with its own prefix index (``policy.index``: feed
    it KV events with `kvtransfer.router.routing.kv_events.KVEventSubscribers`; the router does that
    in `kvtransfer.router.fleet.cache_wiring`). Its blocks are ``config.kv_block_size`` tokens; the
    defaults of `CacheAwareSettings` apply."""
    return CacheAwarePolicy(PrefixIndex(default_block_size=config.kv_block_size), role=role)
