"""The fleet's mode (`routing.fleet_mode`): P/D or aggregated operation, chosen from what the
requests routed under each got. The state machine on a fake clock, the estimate that gates a
first try, each request's score by the router's clock; then with real daemons and with vLLM
stand-ins, requests routed whole over both roles while aggregated, tokens equal to colocated."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from router_helpers.cluster import WAIT_S, run
from router_helpers.fake_vllm import (
    SSE_CHUNKS,
    SSE_DONE,
    VllmBehaviour,
    decode_paced,
    prefill_or_whole,
)
from router_helpers.vllm_cluster import vllm_cluster
from serve_helpers.daemons import PROMPTS, colocated, daemon_pair
from waiting import wait_until_async

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.service import ServiceStats
from kvtransfer.router.flow_rules import SloOutcome
from kvtransfer.router.routing import fleet_mode as fm
from kvtransfer.router.routing.disagg import (
    DECODE_ONLY,
    PREFILL_ONLY,
    SloTargets,
)
from kvtransfer.router.routing.fleet_mode import (
    AGGREGATED_FLEET,
    FLEET_AGGREGATED,
    PD_FLEET,
    FleetMode,
    aggregated_fits,
    aggregated_gap_s,
    aggregated_route,
)
from kvtransfer.router.server import RouterServer
from kvtransfer.serve.launcher import ServiceProcess

SLO = SloTargets(ttft_s=1.0, itl_s=0.1)
MAX_TOKENS = 10


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _score(mode: FleetMode, *met: bool) -> None:
    """Requests admitted and ended one after another, each ``met`` or not."""
    for outcome in met:
        mode.ended(mode.admit(), outcome)


def _fits() -> bool:
    return True


def _never() -> bool:
    raise AssertionError("the estimate was not to be asked")


# ---------------------------------------------------------------------- the state machine


def _mode(window: int = 4) -> tuple[FleetMode, _Clock, list[tuple[str, str]], list[str]]:
    clock = _Clock()
    switches: list[tuple[str, str]] = []
    duels: list[str] = []
    mode = FleetMode(clock, lambda to, why: switches.append((to, why)), duels.append, window=window)
    return mode, clock, switches, duels


def _window(mode: FleetMode, met: int, fits=_never) -> str:
    """A window of requests, ``met`` of them within the targets, then the next request's mode."""
    _score(mode, *(i < met for i in range(mode.window)))
    return mode.current(fits)


@pytest.mark.unit
def test_pd_stays_while_its_windows_meet_the_slos_and_a_low_one_starts_a_duel():
    mode, clock, switches, _ = _mode()
    # No window until 4 requests are scored.
    _score(mode, True, True, True)
    assert mode.current(_never) == PD_FLEET
    _score(mode, True)
    assert mode.current(_never) == PD_FLEET  # 100%: P/D stays, the estimate is not asked
    # 75%, but the estimate says aggregated operation would miss: P/D stays.
    assert _window(mode, 3, lambda: False) == PD_FLEET
    assert switches == []
    # A window that took longer than MAX_WINDOW_S to fill starts no duel either.
    for met in (True, True, True, False):
        clock.now += fm.MAX_WINDOW_S / 2
        mode.ended(mode.admit(), met)
    assert mode.current(_never) == PD_FLEET
    assert _window(mode, 3, _fits) == AGGREGATED_FLEET
    assert switches == [(AGGREGATED_FLEET, "pd met 75%; a duel")]
    assert mode.describe() == {
        "mode": "aggregated",
        "dueling": True,
        "last_duel": {},
        "last_window": {PD_FLEET: 0.75},
    }


@pytest.mark.unit
def test_a_duel_alternates_the_modes_a_window_at_a_time_and_the_larger_share_met_wins():
    mode, clock, switches, duels = _mode()
    assert _window(mode, 2, _fits) == AGGREGATED_FLEET  # P/D 2 of 4: a duel, which it counts
    assert _window(mode, 4) == PD_FLEET
    assert _window(mode, 1) == AGGREGATED_FLEET
    # P/D 3 of 8, aggregated 7 of 8: aggregated wins and stays.
    assert _window(mode, 3) == AGGREGATED_FLEET
    assert duels == [AGGREGATED_FLEET]
    assert switches[-1] == (AGGREGATED_FLEET, "the duel goes on")
    assert mode.describe()["last_duel"] == {PD_FLEET: 3 / 8, AGGREGATED_FLEET: 7 / 8}
    # It holds for HOLD_S, whatever its windows, then duels again from aggregated.
    assert _window(mode, 0) == AGGREGATED_FLEET
    clock.now += fm.HOLD_S + 1
    assert mode.current(_never) == PD_FLEET
    assert switches[-1] == (PD_FLEET, f"a duel after {fm.HOLD_S:.0f} s")
    assert _window(mode, 4) == AGGREGATED_FLEET
    assert _window(mode, 2) == PD_FLEET
    assert _window(mode, 4) == AGGREGATED_FLEET
    # The load fell: P/D 8 of 8, aggregated 4 of 8: back to P/D.
    assert _window(mode, 2) == PD_FLEET
    assert duels == [AGGREGATED_FLEET, PD_FLEET]
    assert switches[-1] == (PD_FLEET, "the duel: P/D met 100%, aggregated 50%")
    # P/D holds too: a low window starts no duel until HOLD_S passed.
    assert _window(mode, 0) == PD_FLEET
    clock.now += fm.HOLD_S + 1
    assert _window(mode, 2, _fits) == AGGREGATED_FLEET
    # A tie goes to P/D.
    for met, expected in ((2, PD_FLEET), (2, AGGREGATED_FLEET), (2, PD_FLEET)):
        assert _window(mode, met) == expected
    assert duels[-1] == PD_FLEET


@pytest.mark.unit
def test_only_requests_admitted_once_the_other_modes_are_gone_are_scored():
    mode, clock, _, _ = _mode(window=2)
    old = [mode.admit(), mode.admit()]  # P/D requests still running at the switch
    assert _window(mode, 0, _fits) == AGGREGATED_FLEET
    # Admitted while P/D's are in flight: not scored, whatever they get.
    early = mode.admit()
    assert not early.scored
    mode.ended(early, True)
    mode.ended(old[0], True)  # a P/D request ending now scores nothing either
    assert mode.current(_never) == AGGREGATED_FLEET
    mode.ended(old[1], None)  # its client left: not scored, but no longer in flight
    # Ending twice counts once: one request, then one more, make the window.
    ticket = mode.admit()
    assert ticket.scored
    mode.ended(ticket, True)
    mode.ended(ticket, True)
    assert mode.current(_never) == AGGREGATED_FLEET
    stuck = mode.admit()
    mode.ended(mode.admit(), True)
    assert mode.current(_never) == PD_FLEET  # the duel goes on
    # A request of the other mode running long is waited for no longer than SETTLE_MAX_S.
    assert not mode.admit().scored
    clock.now += fm.SETTLE_MAX_S + 1
    assert mode.admit().scored
    mode.ended(stuck, True)


@pytest.mark.unit
def test_the_window_is_checked():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        FleetMode(_Clock(), window=0)


# ---------------------------------------------------------------------- the estimate, the route


@dataclass
class _Instance:
    address: str
    in_flight: int = 0
    service: ServiceStats = field(default_factory=ServiceStats)


def _stepping(gaps: dict[int, float], decoding: int = 0) -> _Instance:
    instance = _Instance("127.0.0.1:1")
    for batch, gap in gaps.items():
        instance.service.decoding = batch
        instance.service.token_gap(gap, 1)
    instance.service.decoding = decoding
    return instance


@pytest.mark.unit
def test_the_aggregated_estimate_splits_the_batch_and_the_prompt_work_over_every_instance():
    prefill = _stepping({}, decoding=0)
    decode = _stepping({1: 0.01, 3: 0.03, 5: 0.05}, decoding=6)
    # 6 decoding over 2 instances: 3 each, stepping 30 ms; 0.8 s of prompts a second: 40% of
    # each instance, so the steps come in the other 60%.
    gap = aggregated_gap_s([prefill], [decode], prompt_load=0.8)
    assert gap == pytest.approx(0.03 / 0.6)
    assert aggregated_fits(gap, SloTargets(1.0, 0.045)) is True  # within 1.2 x 45 ms
    assert aggregated_fits(gap, SloTargets(1.0, 0.04)) is False
    # Prompts that would fill the split instances: nothing to try.
    assert aggregated_gap_s([prefill], [decode], prompt_load=2 * fm.MAX_BUSY_SHARE) is None
    assert aggregated_fits(None, SLO) is False


@pytest.mark.unit
def test_aggregated_requests_go_to_the_role_with_the_least_loaded_instance():
    prefill, decode = _Instance("p"), _Instance("d")
    tie = aggregated_route([prefill], [decode])
    assert (tie.mode, tie.reason) == (DECODE_ONLY, FLEET_AGGREGATED)
    decode.in_flight = 1
    assert aggregated_route([prefill], [decode]).mode == PREFILL_ONLY
    prefill.in_flight = 1
    prefill.service.queued_prompt_tokens = 10
    assert aggregated_route([prefill], [decode]).mode == DECODE_ONLY


@pytest.mark.unit
def test_a_requests_score_is_its_first_token_and_mean_gap_by_the_routers_clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("kvtransfer.router.flow_rules.time.monotonic", lambda: now[0])
    mode, _, _, _ = _mode(window=1)

    def scored(first_after: float, gaps: list[float], **close: bool) -> object:
        outcome = SloOutcome(mode, SLO, started=now[0])
        now[0] += first_after
        outcome.tokens(1)
        for gap in gaps:
            now[0] += gap
            outcome.tokens(2)  # two tokens in one delta: the gap is per token
        outcome.close(**close)
        return mode.describe()["last_window"][PD_FLEET]

    assert scored(0.9, [0.18, 0.18]) == 1.0  # 0.36 s over 4 tokens: 0.09 s each
    assert scored(1.1, [0.1]) == 0.0  # the first token late
    assert scored(0.5, [0.21, 0.2]) == 0.0  # 0.1025 s a token
    assert scored(0.5, []) == 1.0  # one token: no gap
    assert scored(0.1, [0.1], failed=True) == 0.0
    mode.ended(mode.admit(), True)
    assert scored(5.0, [5.0], scored=False) == 1.0  # the client left: the score stands
    # Without SLO targets nothing is kept.
    SloOutcome(None, None, started=0.0).close(failed=True)


# ---------------------------------------------------------------------- with real daemons


@pytest.mark.integration
def test_aggregated_operation_runs_requests_whole_on_both_roles_and_equals_colocated(tmp_path):
    with daemon_pair(tmp_path, ["--engine-id", "p"], ["--engine-id", "d"]) as pair:
        _aggregated_operation(*pair)


def _aggregated_operation(prefill: ServiceProcess, decode: ServiceProcess) -> None:
    prompt = list(PROMPTS[1].encode())
    (expected,) = colocated([prompt], MAX_TOKENS)

    async def scenario() -> None:
        config = RouterConfig(
            (prefill.address,),
            (decode.address,),
            slo_ttft_ms=60_000,
            slo_itl_ms=10_000,
            shutdown_timeout_s=5.0,
        )
        async with (
            RouterServer(config) as router,
            aiohttp.ClientSession(base_url=router.url) as http,
        ):
            mode = router.handlers.runner.decider.fleet_mode
            assert mode is not None
            mode.window = 2

            async def routed() -> dict[str, Any]:
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
                async with http.post("/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    events = (await response.text()).split("\n\n")
                info = json.loads(events[-3].removeprefix("data: "))["kvtransfer"]
                assert info["token_ids"] == expected
                return info

            async def windows(count: int) -> bool:
                return mode.windows >= count

            # Two P/D requests, within the generous targets: P/D's window, 100%.
            for _ in range(2):
                assert "decode" in await routed() and mode.mode == PD_FLEET
            await wait_until_async(lambda: windows(1), "a window", WAIT_S)
            assert mode.describe()["last_window"] == {PD_FLEET: 1.0}
            # Two that missed (as under a load these daemons cannot be given here): the
            # estimate lets a duel start, aggregated first.
            _score(mode, False, False)
            # Two at once: the first alone on the decode, the second on the prefill, whose
            # instance has none in flight by then; neither moves KV.
            both = await asyncio.gather(routed(), routed())
            assert mode.mode == AGGREGATED_FLEET
            roles = sorted(next(iter(set(i) & {"prefill", "decode"})) for i in both)
            assert roles == ["decode", "prefill"]
            for info in both:
                assert info["route_decision"]["reason"] == FLEET_AGGREGATED
                assert info["kv_blocks_received"] == 0
            # Scored from their streams as they end: both met the targets.
            await wait_until_async(lambda: windows(3), "aggregated's window", WAIT_S)
            assert mode.describe()["last_window"][AGGREGATED_FLEET] == 1.0
            # The duel goes on (the next request's route asks): a P/D window, one miss and one
            # real request, 50%.
            assert mode.current(_never) == PD_FLEET
            _score(mode, False)
            pd = await routed()
            assert pd["prefill"] == prefill.address and pd["decode"] == decode.address
            await wait_until_async(lambda: windows(4), "P/D's second window", WAIT_S)
            # Aggregated's second window (two more, alone on the decode), then the verdict at
            # the next request: P/D 1 of 4, aggregated 4 of 4.
            for _ in range(2):
                assert (await routed())["route_decision"]["reason"] == FLEET_AGGREGATED
            await wait_until_async(lambda: windows(5), "aggregated's second window", WAIT_S)
            assert (await routed())["route_decision"]["reason"] == FLEET_AGGREGATED
            assert mode.describe()["last_duel"] == {PD_FLEET: 0.25, AGGREGATED_FLEET: 1.0}
            async with http.get("/metrics") as response:
                metrics = (await response.text()).splitlines()
            for line in (
                'kvtransfer_router_fleet_mode_switches_total{mode="aggregated"} 2.0',
                'kvtransfer_router_fleet_mode_switches_total{mode="pd"} 1.0',
                'kvtransfer_router_fleet_duels_total{winner="aggregated"} 1.0',
                "kvtransfer_router_fleet_aggregated 1.0",
                "kvtransfer_router_route_decisions_total"
                '{mode="decode_only",reason="fleet_aggregated"} 4.0',
                "kvtransfer_router_route_decisions_total"
                '{mode="prefill_only",reason="fleet_aggregated"} 1.0',
            ):
                assert line in metrics, line

    asyncio.run(asyncio.wait_for(scenario(), 300))


# ---------------------------------------------------------------------- vLLM stand-ins


@pytest.mark.integration
def test_vllm_requests_are_scored_from_their_streamed_events_and_run_whole_when_aggregated():
    async def scenario() -> None:
        whole = VllmBehaviour(completions=prefill_or_whole(decode_paced(0.01)))
        paced = VllmBehaviour(completions=decode_paced(0.01))
        slo = {"slo_ttft_ms": 60_000, "slo_itl_ms": 1_000}
        async with vllm_cluster([whole], [paced], **slo) as c:
            proxy = c.router.handlers.backend.vllm
            assert proxy is not None and proxy.decider.fleet_mode is not None
            mode = proxy.decider.fleet_mode
            mode.window = 1
            body = {"model": "tiny", "prompt": list(range(1, 20)), "max_tokens": 8}
            body |= {"stream": True}
            code, raw, headers = await c.post(body)
            assert code == 200 and raw == b"".join((*SSE_CHUNKS, SSE_DONE))
            assert headers["x-kvtransfer-route"].startswith("disaggregated")

            async def windows(count: int) -> bool:
                return mode.windows >= count

            # Its events were timed: it met the targets.
            await wait_until_async(lambda: windows(1), "a window", WAIT_S)
            assert mode.describe()["last_window"] == {PD_FLEET: 1.0}
            _score(mode, False)  # one that missed: a duel, aggregated first
            decoded_before = len(c.decodes[0].seen)
            code, raw, headers = await c.post(body)
            assert code == 200 and raw == b"".join((*SSE_CHUNKS, SSE_DONE))
            route = headers["x-kvtransfer-route"]
            assert route.startswith("decode_only; reason=fleet_aggregated"), route
            assert "kv_transfer_params" not in c.decodes[0].seen[-1].body
            assert len(c.decodes[0].seen) == decoded_before + 1
            await wait_until_async(lambda: windows(3), "aggregated's window", WAIT_S)
            assert mode.describe()["last_window"][AGGREGATED_FLEET] == 1.0
            await c.wait_idle()

    run(scenario)
