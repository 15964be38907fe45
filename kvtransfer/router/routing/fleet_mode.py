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

How, measured rather than predicted (the engine's batching decides the outcome), and side by
side (the load moves faster than a mode's score: windows of one mode a few seconds apart scored
17% and 100% at one offered rate on vLLM-CPU):

1. Every request is scored when it ends, by the router's own clock: met (first token within
   the TTFT target, mean gap from its first to its last token within the gap target) or not;
   a failed request is a miss, a request whose client left is not scored. Only requests
   admitted while nothing admitted under the other mode was in flight (or `SETTLE_MAX_S` after
   the switch) are scored: the first ones after a switch meet the other mode's load.
2. Every `WINDOW` scored requests make a window, scored by its share met.
3. In P/D, a window below `ENTER_BELOW`, filled within `MAX_WINDOW_S` (a slower fleet would
   spend minutes dueling while its load moved), starts a duel where the fluid estimate of
   aggregated operation (`aggregated_gap_s`) would not miss the gap target by more than its
   spread (a fleet whose prompts alone would swamp the split instances is not tried). A duel
   alternates the modes a window at a time, the window that started it counting, until each has
   `DUEL_WINDOWS`; the mode with the larger share met over its windows wins (P/D on a tie: it
   is what the fleet is deployed for) and runs for `HOLD_S` without another duel.
4. Aggregated operation duels again after its hold (the load may have fallen); P/D only when a
   window falls below `ENTER_BELOW` again.

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

# Scored requests per window: few enough to follow a change of load within seconds on vLLM.
WINDOW = 24
# A P/D window below this share met starts a duel.
ENTER_BELOW = 0.8
# Only a window filled within this long starts a duel: a duel takes four windows and their
# settling, and a fleet whose requests end slower (our CPU daemons: 24 in 40-80 s) would spend
# minutes in the losing mode while the load moved under it.
MAX_WINDOW_S = 15.0
# Windows of each mode in a duel: with 48 requests each, one outcome's noise is about 0.1.
DUEL_WINDOWS = 2
# How long a duel's winner runs before the next duel may start.
HOLD_S = 60.0
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
    """The fleet's mode and the duels behind it (see the module's docstring). ``clock``:
    seconds (`time.monotonic`); ``on_switch(mode, why)``: told each switch; ``on_duel(winner)``:
    each duel's end."""

    clock: Callable[[], float]
    on_switch: Callable[[str, str], None] | None = None
    on_duel: Callable[[str], None] | None = None
    window: int = WINDOW
    mode: str = PD_FLEET
    epoch: int = 0
    windows: int = 0  # windows scored so far
    _switched_at: float = 0.0
    _held_until: float = float("-inf")
    _in_flight: dict[int, int] = field(default_factory=dict)
    _outcomes: list[bool] = field(default_factory=list)
    # The last window's share met, not acted on yet, and how long it took to fill.
    _window: float | None = None
    _window_s = 0.0
    _window_opened = 0.0
    # In a duel: per mode, [requests met, requests scored, windows].
    _duel: dict[str, list[int]] | None = None
    _last_duel: dict[str, float] = field(default_factory=dict)
    _last_window: dict[str, float] = field(default_factory=dict)

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
        if not self._outcomes:
            self._window_opened = self.clock()
        self._outcomes.append(met)
        if len(self._outcomes) >= self.window:
            self._window_s = self.clock() - self._window_opened
            met_count = sum(self._outcomes)
            self._window = self._last_window[self.mode] = met_count / len(self._outcomes)
            self.windows += 1
            if self._duel is not None:
                tally = self._duel[self.mode]
                tally[0] += met_count
                tally[1] += len(self._outcomes)
                tally[2] += 1
            self._outcomes.clear()
            logger.info(
                "fleet mode %s: %.0f%% of %d requests met both SLOs",
                self.mode,
                100 * self._window,
                self.window,
            )

    def current(self, aggregated_fits: Callable[[], bool]) -> str:
        """The mode for the next request, switched first where a window just ended says so;
        ``aggregated_fits``: whether the estimate lets a duel start from P/D (step 3)."""
        window, self._window = self._window, None
        if window is None:
            if self.mode == AGGREGATED_FLEET and self._duel is None and self._held_over():
                self._start_duel(None)
            return self.mode
        if self._duel is not None:
            self._next_in_duel()
        elif (
            self.mode == PD_FLEET
            and window < ENTER_BELOW
            and self._window_s <= MAX_WINDOW_S
            and self._held_over()
            and aggregated_fits()
        ):
            self._start_duel(window)
        return self.mode

    def _held_over(self) -> bool:
        return self.clock() >= self._held_until

    def _start_duel(self, window: float | None) -> None:
        """A duel from the current mode; ``window``: its last window's share, which counts."""
        self._duel = {PD_FLEET: [0, 0, 0], AGGREGATED_FLEET: [0, 0, 0]}
        if window is not None:
            self._duel[self.mode] = [round(window * self.window), self.window, 1]
            why = f"{self.mode} met {window:.0%}; a duel"
        else:
            why = f"a duel after {HOLD_S:.0f} s"
        self._switch(_other(self.mode), why)

    def _next_in_duel(self) -> None:
        duel = self._duel
        if duel is None:  # only called in a duel; narrows the type
            raise RuntimeError("unreachable: no duel")
        if duel[_other(self.mode)][2] < DUEL_WINDOWS:
            self._switch(_other(self.mode), "the duel goes on")
            return
        if duel[self.mode][2] < DUEL_WINDOWS:
            return
        shares = {mode: met / max(1, scored) for mode, (met, scored, _) in duel.items()}
        self._last_duel = shares
        self._duel = None
        winner = AGGREGATED_FLEET if shares[AGGREGATED_FLEET] > shares[PD_FLEET] else PD_FLEET
        why = f"the duel: P/D met {shares[PD_FLEET]:.0%}, aggregated {shares[AGGREGATED_FLEET]:.0%}"
        self._held_until = self.clock() + HOLD_S
        if self.on_duel is not None:
            self.on_duel(winner)
        if winner != self.mode:
            self._switch(winner, why)
        else:
            logger.info("fleet mode stays %s: %s", self.mode, why)

    def _switch(self, mode: str, why: str) -> None:
        logger.info("fleet mode %s -> %s: %s", self.mode, mode, why)
        self.mode = mode
        self.epoch += 1
        self._switched_at = self.clock()
        self._outcomes.clear()
        if self.on_switch is not None:
            self.on_switch(mode, why)

    def describe(self) -> dict[str, object]:
        """The mode, whether a duel runs, and the shares met of the last duel and of each mode's
        last window."""
        return {
            "mode": self.mode,
            "dueling": self._duel is not None,
            "last_duel": dict(self._last_duel),
            "last_window": dict(self._last_window),
        }


def _other(mode: str) -> str:
    return AGGREGATED_FLEET if mode == PD_FLEET else PD_FLEET


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
