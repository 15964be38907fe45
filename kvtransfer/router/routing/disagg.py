"""Whether a request is worth disaggregating: `decide` picks, per request, between P/D (a
prefill computes the prompt, a decode pulls its KV and decodes), a decode instance alone (it
computes the prompt itself, as a colocated engine would) and, with SLO targets, a prefill
instance alone (the same, on a prefill: no KV moves). Both flows (kvtransfer daemons, vLLM
servers) ask it before they pick instances; an aggregated instance the decode policy picks
afterwards runs a P/D or decode-alone request alone whatever was decided.

Two rules, one decision:

- **Threshold** (``--disagg-min-prompt-tokens N``, no SLOs given): a prompt with fewer than N
  uncached tokens goes alone; every other one is disaggregated (N = 0: always).
- **SLO** (``--slo-ttft-ms`` and ``--slo-itl-ms``): the route predicted to meet both targets,
  from what the router measured of each instance (`kvtransfer.router.fleet.service`):

  * P/D: TTFT = (the prefill's queued prompt tokens + those of the P/D prompts the router
    holds back that this one would follow (`prefill_order`) + this prompt's uncached tokens) /
    its prompt rate (the first token comes from the prefill), the best pickable prefill;
    inter-token latency = the decode's measured gap at its batch + 1, plus the stalls it
    owes its requests, spread over ``max_tokens`` (the stand-in for a request's output): the
    prompts it computed alone within the time a request decodes there, and those queued.
  * Alone on a decode: TTFT the same way on the decode (its own prompt rate, else the
    prefills': the same hardware is assumed); its own gap at batch + 1; and its prompt stalls
    every request decoding there by the prompt's compute time: their gap at the batch plus
    that stall and the ones above, spread over ``max_tokens``, must stay within the target
    too. Those requests are the ones decoding there, and of those routed there still waiting
    for their prefill or KV and those the router's arrival rate (its share per decode) brings
    during the stall, the share whose prefill ends within it (the share of the prefills'
    queued tokens computed meanwhile: under a long prefill queue they are not decoding yet);
    when that makes half a request or more, their gap counts.

  * Alone on a prefill: TTFT the same way on the prefill; its gap, what the requests run
    alone there got lately (`alone_gap_s`), else the prefill's step at its batch + 1 (the
    decodes' when it never decoded) over the share of time its prompts leave it
    (1 - `busy_share`, the queued and held-back prompts included: every prompt a stall); and
    its prompt stalls those decoding there as above.

  P/D is kept when it meets both with its gap within the target by more than the spread of
  the requests' gaps (`GAP_SPREAD`): it keeps prefills off the decodes, which is what
  disaggregation is for. Else a prefill alone, when the requests alone there got a gap
  within the target by that margin, smaller than P/D's (and than a decode alone's, where
  that meets both): a prefill's spare steps carry it while the decodes are at their target.
  Else P/D when it meets both at all; else the decode alone when that meets both. When
  neither does, P/D is predicted to lose the request: a prefill where requests alone got a
  gap within the target takes it, and so does an idle one where none was measured yet while
  its bare step would meet the target (the lost request pays for the measurement): the
  prediction for a prefill alone only ranks prefills, as it erred both ways in the goodput
  runs. Otherwise the decode alone is taken when it reaches the first token sooner and the
  requests its stall is expected to push past the gap target number fewer than one (a stall
  adding d to their mean gap pushes about d / (`GAP_SPREAD` x target) of them past it, those
  already past it aside). A prompt
  below the threshold still goes alone first (a floor), and so does everything while the
  router has measured too little to predict (``no_profile``: the threshold rule decides).

With SLO targets the fleet's mode (`fleet_mode`) is asked first: while the fleet runs
aggregated, every request runs whole on one instance and this rule is not asked.

The static threshold is thus the SLO rule with no targets. Each decision names its reason
(`RouteDecision.reason`, a metric label) and carries its predictions into the answer's
``kvtransfer`` object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvtransfer.router.routing.policy import (
    Candidate,
    Policy,
    RouteContext,
    UncachedEstimator,
    whole_prompt_uncached,
)

if TYPE_CHECKING:
    from kvtransfer.router.config import RouterConfig

DISAGGREGATED = "disaggregated"
DECODE_ONLY = "decode_only"
PREFILL_ONLY = "prefill_only"

# Requests expected to decode on a decode during an alone prompt's stall from which on their gap
# after the stall must meet the target too.
EXPECTED_VICTIMS = 0.5
# How far apart the requests' mean gaps on one decode lie, as a share of the gap target: a
# stall adding d to their gaps pushes about d / (GAP_SPREAD x target) of them past it.
GAP_SPREAD = 0.2
# Over how many seconds a prefill's share of time spent on prompts is read (`busy_share`).
BUSY_WINDOW_S = 10.0
# A busier prefill is taken as full: a request decoding there would get almost no steps.
MAX_BUSY_SHARE = 0.95

# Reasons (the ``reason`` label of kvtransfer_router_route_decisions_total).
ALWAYS = "always_disaggregate"  # no threshold, no SLO
TOKENS_UNKNOWN = "prompt_tokens_unknown"  # a chat, or a text prompt without --tokenizer
BELOW_THRESHOLD = "below_threshold"
AT_THRESHOLD = "at_or_above_threshold"
NO_PROFILE = "no_profile"  # SLOs given, but too little measured yet
PD_MEETS = "pd_meets_slo"
ALONE_MEETS = "alone_meets_slo"  # P/D predicted to miss, alone to meet
NEITHER_PD = "neither_meets_pd"
NEITHER_ALONE = "neither_meets_alone"
# The decodes' gap at or near the target, a prefill's well within it; or P/D predicted to
# miss, a prefill alone to meet.
PREFILL_ALONE = "prefill_alone_meets_slo"
# P/D predicted to miss; an idle prefill's gap for a request alone not measured yet.
NEITHER_PREFILL = "neither_meets_try_prefill"
NO_PREFILL = "no_prefill_pickable"
REASONS = (
    ALWAYS,
    TOKENS_UNKNOWN,
    BELOW_THRESHOLD,
    AT_THRESHOLD,
    NO_PROFILE,
    PD_MEETS,
    ALONE_MEETS,
    NEITHER_PD,
    NEITHER_ALONE,
    PREFILL_ALONE,
    NEITHER_PREFILL,
    NO_PREFILL,
)


class ServiceView(Protocol):
    """What the rule reads of an instance's measured speed (`fleet.service.ServiceStats`)."""

    prompt_tokens_per_s: float | None
    queued_prompt_tokens: int

    @property
    def batch(self) -> int: ...

    def inter_token_s(self, batch: int) -> float | None: ...

    def stall_s(self, within_s: float) -> float: ...

    def busy_share(self, within_s: float, extra_s: float = 0.0) -> float: ...

    @property
    def decoding(self) -> int: ...

    @property
    def alone_gap_s(self) -> float | None: ...


class SloCandidate(Candidate, Protocol):
    """A pickable instance as the rule sees it: a policy's `Candidate` with its speed."""

    service: ServiceView


@dataclass(frozen=True)
class SloTargets:
    """Per-request targets: time to first token and mean inter-token latency, in seconds."""

    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class DisaggRule:
    """``threshold``: ``disagg_min_prompt_tokens`` (0: none); ``slo``: targets, or ``None``."""

    threshold: int = 0
    slo: SloTargets | None = None

    @classmethod
    def of(cls, config: RouterConfig) -> DisaggRule:
        slo = None
        if config.slo_ttft_ms > 0:
            slo = SloTargets(config.slo_ttft_ms / 1e3, config.slo_itl_ms / 1e3)
        return cls(config.disagg_min_prompt_tokens, slo)


@dataclass(frozen=True)
class RouteDecision:
    """P/D (``disaggregated``), a decode alone (``decode_only``) or a prefill alone
    (``prefill_only``), and why."""

    mode: str
    reason: str
    uncached_tokens: int | None = None
    # Predicted seconds: ttft_pd_s, itl_pd_s, ttft_alone_s, itl_alone_s, itl_others_s and,
    # where P/D's gap was not well within the target, ttft_prefill_s, itl_prefill_s and
    # itl_prefill_others_s.
    predicted: dict[str, float] = field(default_factory=dict)

    @property
    def alone(self) -> bool:
        """On a decode instance alone (it computes the prompt itself)."""
        return self.mode == DECODE_ONLY

    @property
    def on_prefill(self) -> bool:
        """On a prefill instance alone: it computes the prompt and decodes, no KV moves."""
        return self.mode == PREFILL_ONLY

    def describe(self) -> dict[str, object]:
        """The ``route_decision`` of the answer's ``kvtransfer`` object."""
        return {
            "mode": self.mode,
            "reason": self.reason,
            "uncached_tokens": self.uncached_tokens,
            "predicted": {name: round(value, 6) for name, value in self.predicted.items()},
        }


def decide(
    rule: DisaggRule,
    route: RouteContext,
    max_tokens: int,
    prefills: Sequence[SloCandidate],
    decodes: Sequence[SloCandidate],
    decode_policy: Policy,
    arrivals_per_s: float = 0.0,
    waiting: WaitingPrompts | None = None,
) -> RouteDecision:
    """The route of one request (see the module's docstring): ``prefills`` and ``decodes``
    are the pickable instances of each role (decode daemons only: an aggregated instance never
    takes KV), ``decode_policy`` the one whose prefix index, when it keeps one, says how much of
    the prompt is cached; ``arrivals_per_s`` the router's request rate (its share per decode
    arrives during a decode-alone prompt's stall); ``waiting``, the P/D requests the router
    holds back from busy prefills (`prefill_order`): a P/D prompt waits for those it would
    follow. With no prefill pickable, every request goes alone."""
    if not prefills:
        # Nothing to disaggregate with: the decode policy's pick (an aggregated instance, or a
        # decode daemon) computes the prompt itself.
        return RouteDecision(DECODE_ONLY, NO_PREFILL)
    if rule.threshold <= 0 and rule.slo is None:
        return RouteDecision(DISAGGREGATED, ALWAYS)
    if route.token_ids is None:
        return RouteDecision(DISAGGREGATED, TOKENS_UNKNOWN)
    if isinstance(decode_policy, UncachedEstimator) and decodes:
        uncached = decode_policy.uncached_tokens(decodes, route)
    else:
        uncached = whole_prompt_uncached(decodes, route)
    if uncached < rule.threshold:
        return RouteDecision(DECODE_ONLY, BELOW_THRESHOLD, uncached)
    if rule.slo is None:
        return RouteDecision(DISAGGREGATED, AT_THRESHOLD, uncached)
    arrivals = arrivals_per_s / max(1, len(decodes))
    # A P/D prompt also waits for the held-back ones sent on before it (`prefill_order`).
    ahead = 0 if waiting is None else waiting.tokens_ahead(uncached)
    held = 0 if waiting is None else waiting.waiting_tokens
    return _by_slo(rule.slo, prefills, decodes, uncached, max(1, max_tokens), arrivals, ahead, held)


class WaitingPrompts(Protocol):
    """The P/D prompts the router holds back from busy prefills (`prefill_order`)."""

    @property
    def waiting_tokens(self) -> int: ...

    def tokens_ahead(self, tokens: int) -> int: ...


def prefill_s(prefills: Sequence[SloCandidate], tokens: int) -> float | None:
    """The time to compute ``tokens`` uncached prompt tokens on the best of ``prefills`` now,
    each one's queue first (None: no prompt rate measured yet)."""
    times = [
        _prompt_s(p, tokens, p.service.prompt_tokens_per_s)
        for p in prefills
        if p.service.prompt_tokens_per_s
    ]
    return min(times, default=None)


def _prompt_s(instance: SloCandidate, tokens: int, rate: float) -> float:
    return (instance.service.queued_prompt_tokens + tokens) / rate


def _by_slo(
    slo: SloTargets,
    prefills: Sequence[SloCandidate],
    decodes: Sequence[SloCandidate],
    uncached: int,
    max_tokens: int,
    arrivals_per_s: float,
    ahead: int,
    held: int,
) -> RouteDecision:
    rates = [p.service.prompt_tokens_per_s for p in prefills]
    known = [(p, r) for p, r in zip(prefills, rates, strict=True) if r]
    if not known or not decodes:
        return RouteDecision(DISAGGREGATED, NO_PROFILE, uncached)
    prefill_rate = max(r for _, r in known)
    ttft_pd = min(_prompt_s(p, ahead + uncached, r) for p, r in known)
    predicted = {"ttft_pd_s": ttft_pd}
    # The decode's own gap at one more request, and the stalls it owes; unmeasured counts as
    # meeting the target (an instance that never decoded is idle or new).
    owed = [_owed(d, max_tokens) for d in decodes]  # read once: it walks the stall log
    itl_pd = min(_gap(d, d.service.batch + 1) + o for d, o in zip(decodes, owed, strict=True))
    predicted["itl_pd_s"] = itl_pd
    pd_ok = ttft_pd <= slo.ttft_s and itl_pd <= slo.itl_s
    # The share of the prefills' queue computed within a time: the requests waiting for a
    # prefill start decoding in that order, so only that share of them joins a decode's batch.
    queued = sum(p.service.queued_prompt_tokens for p, _ in known) + held
    total_rate = sum(r for _, r in known)

    def prefilled_within(seconds: float) -> float:
        return min(1.0, seconds * total_rate / queued) if queued else 1.0

    best: tuple[float, float, float, float] | None = None  # ttft, own, others, expected flips
    for d, owed_d in zip(decodes, owed, strict=True):
        rate = d.service.prompt_tokens_per_s or prefill_rate
        ttft = _prompt_s(d, uncached, rate)
        # Its prompt stalls, for its whole compute time, every request decoding there by then:
        # those decoding now, and those routed there (waiting for a prefill or their KV) or
        # arriving meanwhile whose prefill ends within the stall (a long prompt alone on an
        # idle decode still stalls them).
        stall = uncached / rate
        share = prefilled_within(stall)
        not_decoding = max(0, d.in_flight - d.service.batch)
        batch = d.service.batch + (not_decoding + arrivals_per_s * stall) * share
        own = _gap(d, round(batch) + 1)
        others = flips = 0.0
        if batch >= EXPECTED_VICTIMS:
            added = stall / max_tokens
            others = _gap(d, max(1, round(batch))) + owed_d + added
            flips = _expected_flips(batch, others, added, slo.itl_s)
        if best is None or ttft < best[0]:
            best = (ttft, own, others, flips)
    if best is None:  # decodes is not empty; narrows the type
        raise RuntimeError("unreachable: no decode to go alone on")
    ttft_alone, itl_alone, itl_others, flips = best
    predicted.update(ttft_alone_s=ttft_alone, itl_alone_s=itl_alone, itl_others_s=itl_others)
    alone_ok = ttft_alone <= slo.ttft_s and itl_alone <= slo.itl_s and itl_others <= slo.itl_s
    # Within the target by less than the spread of the requests' gaps, a share of them miss.
    within = (1.0 - GAP_SPREAD) * slo.itl_s
    if pd_ok and itl_pd <= within:
        return RouteDecision(DISAGGREGATED, PD_MEETS, uncached, predicted)
    on_prefill = _on_prefill(known, decodes, uncached, max_tokens, held / total_rate, slo)
    if on_prefill is not None:
        predicted.update(
            ttft_prefill_s=on_prefill.ttft_s,
            itl_prefill_s=on_prefill.itl_s,
            itl_prefill_others_s=on_prefill.others_s,
        )
        meets = on_prefill.itl_s <= within and on_prefill.others_s <= slo.itl_s
        # A request P/D would serve leaves it only on evidence (what requests alone there got),
        # and only for a smaller gap: a prefill's steps are lent.
        smaller = on_prefill.itl_s < min(itl_pd, itl_alone if alone_ok else itl_pd)
        if on_prefill.measured and meets and smaller:
            return RouteDecision(PREFILL_ONLY, PREFILL_ALONE, uncached, predicted)
    if pd_ok:
        return RouteDecision(DISAGGREGATED, PD_MEETS, uncached, predicted)
    if alone_ok:
        return RouteDecision(DECODE_ONLY, ALONE_MEETS, uncached, predicted)
    # Neither meets both: P/D is predicted to lose this request. A prefill where requests
    # alone got a gap within the target takes it; so does an idle one where none was measured
    # yet, to measure it at the price of a request P/D would lose anyway. The model alone
    # decides nothing here: how much prompts slow the tokens computed beside them is the
    # engine's doing, and the load that comes after (it predicted 11 ms for requests that got
    # 75 ms on a vLLM prefill, and sent requests that missed on a kvtransfer one).
    if on_prefill is not None and on_prefill.others_s <= slo.itl_s:
        if on_prefill.measured and on_prefill.itl_s <= slo.itl_s:
            return RouteDecision(PREFILL_ONLY, PREFILL_ALONE, uncached, predicted)
        if on_prefill.probe:
            return RouteDecision(PREFILL_ONLY, NEITHER_PREFILL, uncached, predicted)
    # Alone on a decode, when it reaches the first token sooner, costs the requests its stall
    # pushes past the gap target: it goes alone when those are expected to be fewer than the
    # one request P/D loses.
    if ttft_alone < ttft_pd and flips < 1:
        return RouteDecision(DECODE_ONLY, NEITHER_ALONE, uncached, predicted)
    return RouteDecision(DISAGGREGATED, NEITHER_PD, uncached, predicted)


@dataclass(frozen=True)
class _OnPrefill:
    """A request alone on a prefill, as predicted: its TTFT, its gap, the gap of those
    decoding there after its prompt; ``measured``: the gap is what requests alone there got;
    ``probe``: it is the model's, for a prefill that no request decodes on now whose bare
    steps would meet the target (`_on_prefill`)."""

    ttft_s: float
    itl_s: float
    others_s: float
    measured: bool
    probe: bool


def _on_prefill(
    known: Sequence[tuple[SloCandidate, float]],
    decodes: Sequence[SloCandidate],
    uncached: int,
    max_tokens: int,
    held_s: float,
    slo: SloTargets,
) -> _OnPrefill | None:
    """The best prefill to run a request alone on: of those that reach the first token within
    the target, the one with the smallest gap; None when none does.

    The gap is what the requests run alone there got lately (`alone_gap_s`), measured. Else
    it is predicted: a request decoding on a prefill gets the steps its prompts leave, so its
    gap is the step at its batch over the share of time not spent on prompts (`busy_share`
    over `BUSY_WINDOW_S`, the prompts queued there and those the router holds back, ``held_s``
    seconds at the prefills' rate, counted as coming within it; a prefill busier than
    `MAX_BUSY_SHARE` is no candidate). A prefill that never decoded is taken to step as fast
    as the decodes (the same hardware). Its prompt stalls the requests decoding there as a
    decode-alone prompt does."""
    best: _OnPrefill | None = None
    for prefill, rate in known:
        service = prefill.service
        ttft = _prompt_s(prefill, uncached, rate)
        if ttft > slo.ttft_s:
            continue
        batch = service.batch
        measured = service.alone_gap_s
        step = _step_gap(prefill, batch + 1, decodes)
        if measured is not None:
            own = gap = measured
        else:
            busy = service.busy_share(BUSY_WINDOW_S, held_s / len(known))
            if busy >= MAX_BUSY_SHARE:
                continue
            own = step / (1.0 - busy)
            gap = _step_gap(prefill, batch, decodes) / (1.0 - busy)
        others = gap + uncached / rate / max_tokens if batch >= EXPECTED_VICTIMS else 0.0
        # Worth measuring where its steps alone would meet the target and nobody decodes
        # there yet (one such request at a time).
        probe = measured is None and service.decoding == 0 and step <= slo.itl_s
        if best is None or own < best.itl_s:
            best = _OnPrefill(ttft, own, others, measured is not None, probe)
    return best


def _step_gap(instance: SloCandidate, batch: int, peers: Sequence[SloCandidate]) -> float:
    """``instance``'s measured gap at ``batch``, else the fastest of ``peers``' (0: none)."""
    gap = instance.service.inter_token_s(batch)
    if gap is not None:
        return gap
    measured = [g for g in (p.service.inter_token_s(batch) for p in peers) if g is not None]
    return min(measured, default=0.0)


def _expected_flips(victims: float, after: float, added: float, target: float) -> float:
    """How many of ``victims`` requests a stall adding ``added`` seconds to their mean gap
    (``after``, with it) pushes past ``target``. Their gaps lie about `GAP_SPREAD` x the
    target around the predicted one, so the share that was within the target and is not
    after is about ``added`` over that spread."""
    if after <= target:
        return 0.0
    return victims * min(1.0, added / (GAP_SPREAD * target))


def _owed(decode: SloCandidate, max_tokens: int) -> float:
    """Per token, the stalls a request decoding on ``decode`` now has met or will meet: its own
    prompts computed within the time a request decodes there, and those queued there."""
    decoding_s = max_tokens * _gap(decode, max(1, decode.service.batch))
    return decode.service.stall_s(decoding_s) / max_tokens


def _gap(instance: SloCandidate, batch: int) -> float:
    gap = instance.service.inter_token_s(batch)
    return 0.0 if gap is None else gap
