"""How the router picks an instance of a role: the `Policy` interface and the built-in policies.

A policy is asked to `Policy.choose` among `Candidate`s: the instances of one role that may be
picked now (health SERVING, circuit breaker not open, not being removed), never an empty
sequence, in the fleet's order (the order they were added). It returns one of them, the very
object. After every pick the fleet calls `Policy.observe` with the chosen candidate, so a policy
that learns from its own decisions (an approximate prefix index) learns there. Both run on the
router's event loop, between two awaits: no locking, no blocking.

What a policy sees of an instance is the router's own count of requests routed to it and not
finished (`Candidate.in_flight`, always fresh) and the instance's last report (`InstanceLoad`,
polled from its KVAdmin ``GetStatus`` every health interval, so up to one interval stale;
``None`` until the first report, or when the instance reports none). `load_score` combines them
without counting this router's requests twice: a report's running and waiting requests include
the ones this router had in flight when it was read (``router_in_flight``); only the rest, the
other routers' share, is added to the fresh count.

Built in (vLLM Router's names):

- ``round_robin``: the candidates in turn.
- ``least_load``: the lowest `load_score`, then the lowest KV-cache use; ties in turn (so an
  idle fleet is served round robin).
- ``power_of_two``: two candidates drawn at random, the lower `load_score` of the two.
- ``cache_aware``: lives in ``kvtransfer.router.routing.cache_policy`` (a KV-event-driven prefix
  index). That module provides ``create_policy(role: str, config: RouterConfig) -> Policy``; its
  policy may also implement `UncachedEstimator`, which conditional disaggregation then uses (a
  build without that module refuses the name, saying so).

`RouteContext` carries what is known of the request: its id and, when known, its prompt's token
ids (a prompt given as token ids; a text prompt when a `PromptTokenizer` is configured; never a
chat, which the prefill daemon renders with its own template).
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvtransfer.router.names import (
    CACHE_AWARE_MODULE,
    LEAST_LOAD,
    POWER_OF_TWO,
    ROUND_ROBIN,
    check_policy_name,
)

if TYPE_CHECKING:
    from kvtransfer.router.config import RouterConfig
    from kvtransfer.router.openai.requests import Prompt


@dataclass(frozen=True)
class InstanceLoad:
    """An instance's own report of its load, as its last ``GetStatus`` answered.

    ``router_in_flight`` is this router's count of requests in flight on it when the report was
    read (the report counts those too)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    router_in_flight: int = 0

    @property
    def others(self) -> int:
        """Requests the instance holds that this router did not send (other routers' share)."""
        return max(0, self.running + self.waiting - self.router_in_flight)

    @property
    def kv_usage(self) -> float:
        """Share of its KV blocks in use, 0 when it reported no pool."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Candidate(Protocol):
    """What a policy sees of an instance."""

    address: str
    in_flight: int  # requests this router routed to it that have not finished
    load: InstanceLoad | None  # its last report; None before the first or without one


@dataclass(frozen=True)
class RouteContext:
    """What is known of the request being routed: its id (the one the daemons see) and its
    prompt's token ids when the router knows them (``None`` otherwise).

    ``predicted_cached_tokens``: per role, the prompt tokens the role's policy expected the
    instance it picked last to hold (set at the pick by policies that keep a prefix index),
    compared with what the engine reports once the request ends."""

    request_id: str
    token_ids: tuple[int, ...] | None = None
    predicted_cached_tokens: dict[str, int] = field(default_factory=dict, compare=False)


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], route: RouteContext) -> Candidate:
        """One of ``candidates`` (never empty), the object itself."""
        ...

    def observe(self, chosen: Candidate, route: RouteContext) -> None:
        """Called after every pick with the chosen candidate (an approximate index learns
        here)."""
        ...


@runtime_checkable
class CandidateEstimator(Protocol):
    """A policy that can tell how much of a prompt one instance would have to compute (its
    prefix index's view): the prediction compared with the engine's report."""

    def candidate_uncached_tokens(self, candidate: Candidate, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` that ``candidate`` would compute (at least 1)."""
        ...


@runtime_checkable
class UncachedEstimator(Protocol):
    """A policy that can tell how much of a prompt no decode instance holds in its cache;
    conditional disaggregation asks the decode policy when it implements this."""

    def uncached_tokens(self, candidates: Sequence[Candidate], route: RouteContext) -> int:
        """Prompt tokens (of ``route.token_ids``, known) that the best of ``candidates`` would
        have to compute."""
        ...


PromptTokenizer = Callable[["Prompt"], "Sequence[int] | None"]
"""A prompt's token ids as the engines will see them, or ``None`` when not known (a chat)."""


def token_ids_of(prompt: Prompt) -> tuple[int, ...] | None:
    """The default `PromptTokenizer`: only prompts given as token ids are known."""
    if isinstance(prompt, tuple):
        return prompt
    return None


def whole_prompt_uncached(candidates: Sequence[Candidate], route: RouteContext) -> int:
    """The default estimate: nothing is cached anywhere."""
    return len(route.token_ids or ())


def load_score(candidate: Candidate) -> int:
    """Requests in flight on ``candidate``: this router's, plus the others its report adds."""
    load = candidate.load
    return candidate.in_flight + (load.others if load is not None else 0)


def _kv_usage(candidate: Candidate) -> float:
    return candidate.load.kv_usage if candidate.load is not None else 0.0


class RoundRobin:
    name = ROUND_ROBIN

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], route: RouteContext) -> Candidate:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen

    def observe(self, chosen: Candidate, route: RouteContext) -> None:
        return None


class LeastLoad:
    name = LEAST_LOAD

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], route: RouteContext) -> Candidate:
        keys = [(load_score(c), _kv_usage(c)) for c in candidates]
        lowest = min(keys)
        tied = [c for c, key in zip(candidates, keys, strict=True) if key == lowest]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def observe(self, chosen: Candidate, route: RouteContext) -> None:
        return None


class PowerOfTwo:
    name = POWER_OF_TWO

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], route: RouteContext) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return first if load_score(first) <= load_score(second) else second

    def observe(self, chosen: Candidate, route: RouteContext) -> None:
        return None


def create_policy(name: str, role: str, config: RouterConfig) -> Policy:
    """A fresh policy ``name`` for ``role`` (each role has its own, state included)."""
    check_policy_name(name)
    if name == ROUND_ROBIN:
        return RoundRobin()
    if name == LEAST_LOAD:
        return LeastLoad()
    if name == POWER_OF_TWO:
        return PowerOfTwo()
    module = importlib.import_module(CACHE_AWARE_MODULE)
    policy: Policy = module.create_policy(role, config)
    return policy
