"""The router's route decision (`routing.disagg`) and what it predicts from (`fleet.service`):
the measured-speed bookkeeping and each rule's reasons, one layer at a time; then with real
daemons, every route taken when its condition holds, with tokens equal to colocated."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from serve_helpers.daemons import PROMPTS, colocated, exit_used_blocks, running, start_daemon

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.fleet.service import (
    ALONE_MEMORY_S,
    MAX_STALLS,
    STALL_MEMORY_S,
    ServerTiming,
    ServiceStats,
)
from kvtransfer.router.fleet.vllm_endpoint import parse_vllm_metrics
from kvtransfer.router.routing.disagg import (
    ALONE_MEETS,
    ALWAYS,
    AT_THRESHOLD,
    BELOW_THRESHOLD,
    DECODE_ONLY,
    DISAGGREGATED,
    NEITHER_ALONE,
    NEITHER_PD,
    NEITHER_PREFILL,
    NO_PREFILL,
    NO_PROFILE,
    PD_MEETS,
    PREFILL_ALONE,
    PREFILL_ONLY,
    TOKENS_UNKNOWN,
    DisaggRule,
    SloTargets,
    decide,
)
from kvtransfer.router.routing.policy import InstanceLoad, RoundRobin, RouteContext
from kvtransfer.router.server import RouterServer

MAX_TOKENS = 10
SLO = SloTargets(ttft_s=1.0, itl_s=0.1)


@dataclass
class _Instance:
    address: str
    in_flight: int = 0
    load: InstanceLoad | None = None
    service: ServiceStats = field(default_factory=ServiceStats)


def _measured(
    rate: float | None, itl: dict[int, float] | None = None, queued: int = 0
) -> _Instance:
    instance = _Instance(f"127.0.0.1:{id(rate) % 60000 + 1}")
    instance.service.prompt_tokens_per_s = rate
    instance.service.queued_prompt_tokens = queued
    for batch, gap in (itl or {}).items():
        instance.service.decoding = batch
        instance.service.token_gap(gap, 1)
    instance.service.decoding = 0
    return instance


def _decide(
    rule: DisaggRule,
    prompt_tokens: int | None,
    prefills,
    decodes,
    max_tokens=64,
    arrivals=0.0,
    waiting=None,
):
    ids = None if prompt_tokens is None else tuple(range(prompt_tokens))
    route = RouteContext("r", ids)
    return decide(rule, route, max_tokens, prefills, decodes, RoundRobin(), arrivals, waiting)


# ---------------------------------------------------------------------- the bookkeeping


@pytest.mark.unit
def test_prompt_rate_counts_service_time_not_the_queue_behind_another_prompt(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stats = ServiceStats()
    first, second = stats.prompt_started(1000), stats.prompt_started(500)
    assert stats.queued_prompt_tokens == 1500
    clock[0] = 101.0
    stats.prompt_done(first)
    assert stats.prompt_tokens_per_s == 1000.0
    # Served after the first one ended: 0.5 s of its own, not the 1.5 s since it started.
    clock[0] = 101.5
    stats.prompt_done(second, computed_tokens=250)
    # Tokens and seconds are averaged apart: (0.8 x 1000 + 0.2 x 250) / (0.8 x 1 + 0.2 x 0.5).
    assert stats.prompt_tokens_per_s == pytest.approx(850 / 0.9)
    assert stats.queued_prompt_tokens == 0
    # Ending twice, or abandoning an ended prompt, changes nothing.
    stats.prompt_done(second)
    stats.prompt_abandoned(first)
    assert stats.queued_prompt_tokens == 0
    failed = stats.prompt_started(300)
    stats.prompt_abandoned(failed)
    assert (stats.queued_prompt_tokens, stats.prompt_tokens_per_s) == (0, pytest.approx(850 / 0.9))


@pytest.mark.unit
def test_inter_token_latency_is_kept_per_batch_and_interpolated():
    stats = ServiceStats()
    assert stats.inter_token_s(1) is None
    stats.decoding = 1
    stats.token_gap(0.2, 2)  # two tokens in one delta: 0.1 s each
    assert stats.inter_token_s(1) == pytest.approx(0.1)
    # One bucket: flat everywhere.
    assert stats.inter_token_s(8) == pytest.approx(0.1)
    stats.decoding = 3
    stats.token_gap(0.3, 1)
    assert stats.inter_token_s(2) == pytest.approx(0.2)  # between the buckets
    assert stats.inter_token_s(5) == pytest.approx(0.5)  # the last slope, upwards
    assert stats.inter_token_s(0) == pytest.approx(0.1)  # batches start at 1
    stats.token_gap(-1.0, 1)
    stats.token_gap(1.0, 0)
    assert stats.describe()["inter_token_s_by_batch"] == {1: 0.1, 3: 0.3}


@pytest.mark.unit
def test_gaps_while_a_prompt_computes_are_stalls_kept_apart_from_the_steps(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stats = ServiceStats()
    stats.decoding = 2
    stats.token_gap(0.05, 1)
    ticket = stats.prompt_started(400)
    clock[0] = 101.0
    stats.token_gap(0.9, 1)  # during the prompt: a stall, not the pace of a step
    assert stats.stall_s(10.0) == 0.0  # queued, but no rate known to time it by
    stats.prompt_tokens_per_s = 800.0
    assert stats.stall_s(10.0) == pytest.approx(0.5)  # 400 tokens queued at 800/s
    clock[0] = 102.0
    stats.prompt_done(ticket)
    stats.token_gap(0.7, 1)  # began before the prompt ended
    clock[0] = 102.5
    stats.token_gap(0.05, 1)
    assert stats.describe()["inter_token_s_by_batch"] == {2: pytest.approx(0.05)}
    # Its 2 s of service are the stall, remembered for a window that reaches back to it.
    assert stats.stall_s(1.0) == pytest.approx(2.0)
    clock[0] = 104.0
    assert stats.stall_s(1.0) == 0.0
    assert stats.stall_s(5.0) == pytest.approx(2.0)
    # An abandoned prompt leaves no stall, but the instance was busy until it was let go.
    failed = stats.prompt_started(100)
    clock[0] = 104.2
    stats.prompt_abandoned(failed)
    stats.token_gap(0.3, 1)
    assert stats.describe()["inter_token_s_by_batch"] == {2: pytest.approx(0.05)}
    assert stats.stall_s(5.0) == pytest.approx(2.0)


@pytest.mark.unit
def test_a_prefill_serving_for_days_keeps_a_bounded_memory_of_stalls(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stats = ServiceStats()
    for _ in range(3 * MAX_STALLS):  # a prefill: its calls end, nobody asks for its stalls
        ticket = stats.prompt_started(10)
        clock[0] += 0.01
        stats.prompt_done(ticket)
    assert len(stats._stalls) == MAX_STALLS
    clock[0] += STALL_MEMORY_S + 1
    ticket = stats.prompt_started(10)
    clock[0] += 0.5
    stats.prompt_done(ticket)
    assert len(stats._stalls) == 1 and stats.stall_s(STALL_MEMORY_S) == pytest.approx(0.5)


@pytest.mark.unit
def test_a_servers_own_timing_replaces_the_routers_once_it_shows_tokens():
    stats = ServiceStats()
    stats.decoding = 1
    stats.token_gap(0.5, 1)  # the router's own timing, until the server's shows gaps
    stats.server_timing(ServerTiming(itl_sum_s=10.0, itl_count=100, running=2))
    assert (stats.itl_source, stats.server_running, stats.batch) == ("router", 2, 2)
    stats.server_timing(ServerTiming(itl_sum_s=10.0, itl_count=100, running=4))
    assert stats.itl_source == "router"  # no token between the readings: no sample
    # 40 gaps in 2 s between readings, at 4 then 2 running: 50 ms at batch 3.
    stats.server_timing(ServerTiming(itl_sum_s=12.0, itl_count=140, running=2))
    assert stats.itl_source == "vllm"
    assert stats.describe()["inter_token_s_by_batch"] == {1: 0.5, 3: pytest.approx(0.05)}
    stats.token_gap(9.0, 1)  # the router's timing is no longer filed
    assert stats.inter_token_s(3) == pytest.approx(0.05)
    # A restarted server's counters start over: no sample from the drop, the next one counts.
    stats.server_timing(ServerTiming(itl_sum_s=1.0, itl_count=10, running=0))
    assert stats.inter_token_s(3) == pytest.approx(0.05)
    assert (stats.server_running, stats.batch) == (0, 1)
    stats.server_timing(ServerTiming(itl_sum_s=1.5, itl_count=20, running=0))
    assert stats.inter_token_s(1) == pytest.approx(0.8 * 0.5 + 0.2 * 0.05)


@pytest.mark.unit
def test_vllms_metrics_give_load_and_timing_summed_over_its_engines():
    text = "\n".join(
        f'{name}{{engine="{engine}",model_name="m"}} {value}'
        for engine in (0, 1)
        for name, value in (
            ("vllm:num_requests_running", 2),
            ("vllm:num_requests_waiting", 1),
            ("vllm:kv_cache_usage_perc", 0.25),
            ("vllm:inter_token_latency_seconds_sum", 1.5),
            ("vllm:inter_token_latency_seconds_count", 30),
        )
    )
    load, timing = parse_vllm_metrics(text + "\n")
    assert load is not None and (load.running, load.waiting) == (4, 2)
    assert timing == ServerTiming(itl_sum_s=3.0, itl_count=60, running=4)
    # Gauges without the histogram: a load, no timing; a NaN sum: no timing either.
    gauges_only = "vllm:num_requests_running 3\n"
    assert parse_vllm_metrics(gauges_only)[1] is None
    nan_sum = gauges_only + "vllm:inter_token_latency_seconds_sum NaN\n"
    nan_sum += "vllm:inter_token_latency_seconds_count 3\n"
    assert parse_vllm_metrics(nan_sum)[1] is None
    assert parse_vllm_metrics("not prometheus {{{") == (None, None)


# ---------------------------------------------------------------------- the rules


@pytest.mark.unit
def test_without_slos_the_threshold_decides_and_zero_always_disaggregates():
    p, d = _measured(1000.0), _measured(1000.0)
    assert _decide(DisaggRule(), 5, [p], [d]).reason == ALWAYS
    rule = DisaggRule(threshold=8)
    below = _decide(rule, 7, [p], [d])
    assert (below.mode, below.reason, below.uncached_tokens) == (DECODE_ONLY, BELOW_THRESHOLD, 7)
    at = _decide(rule, 8, [p], [d])
    assert (at.mode, at.reason) == (DISAGGREGATED, AT_THRESHOLD)
    unknown = _decide(rule, None, [p], [d])
    assert (unknown.mode, unknown.reason, unknown.uncached_tokens) == (
        DISAGGREGATED,
        TOKENS_UNKNOWN,
        None,
    )


@pytest.mark.unit
def test_each_slo_reason_when_its_condition_holds(monkeypatch):
    rule = DisaggRule(slo=SLO)
    # Nothing measured: disaggregate, saying why.
    assert _decide(rule, 100, [_measured(None)], [_measured(None)]).reason == NO_PROFILE
    assert _decide(rule, 100, [], [_measured(None)]).reason == NO_PREFILL
    # An idle prefill at 1000 tokens/s computes 500 tokens in 0.5 s <= 1 s: P/D.
    decision = _decide(rule, 500, [_measured(1000.0)], [_measured(None, {1: 0.05})])
    assert (decision.mode, decision.reason) == (DISAGGREGATED, PD_MEETS)
    assert decision.predicted["ttft_pd_s"] == pytest.approx(0.5)
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.05)
    # The prefill has 2000 tokens queued (2.5 s); the idle decode computes 500 at the
    # prefill's rate, 0.5 s: alone.
    busy = _measured(1000.0, queued=2000)
    decision = _decide(rule, 500, [busy], [_measured(None, {1: 0.05})])
    assert (decision.mode, decision.reason) == (DECODE_ONLY, ALONE_MEETS)
    assert decision.predicted["ttft_alone_s"] == pytest.approx(0.5)
    # The decode's own measured rate wins over the prefill's.
    slow = _measured(250.0, {1: 0.05})
    decision = _decide(rule, 500, [busy], [slow])
    assert decision.predicted["ttft_alone_s"] == pytest.approx(2.0)
    assert decision.reason == NEITHER_ALONE  # both miss; alone misses by less, harms nobody
    slower = _measured(200.0, {1: 0.05})  # 2.5 s: no better than the prefill's queue
    assert _decide(rule, 500, [busy], [slower]).reason == NEITHER_PD
    # Requests decoding there would stall: 500 tokens at 1000/s = 0.5 s over 4 tokens each.
    crowded = _measured(1000.0, {1: 0.05, 2: 0.06})
    crowded.service.decoding = 2
    decision = _decide(rule, 500, [_measured(1000.0, queued=5000)], [crowded], max_tokens=4)
    assert decision.predicted["itl_others_s"] == pytest.approx(0.06 + 0.5 / 4)
    assert (decision.mode, decision.reason) == (DISAGGREGATED, NEITHER_PD)
    # Requests routed there and not decoding yet count as far as their prefill ends within the
    # stall: both when the prefills have nothing queued ...
    waiting = _measured(1000.0, {1: 0.05, 2: 0.06})
    waiting.in_flight = 2
    decision = _decide(rule, 500, [_measured(1000.0)], [waiting], max_tokens=4)
    assert decision.predicted["itl_others_s"] == pytest.approx(0.06 + 0.5 / 4)
    assert decision.predicted["itl_alone_s"] == pytest.approx(0.07)  # extrapolated to 3
    # ... none behind 5 s of queued prefill: the 0.5 s stall computes a tenth of it (0.2 of them).
    decision = _decide(rule, 500, [_measured(1000.0, queued=5000)], [waiting], max_tokens=4)
    assert decision.predicted["itl_others_s"] == 0.0
    assert decision.predicted["itl_alone_s"] == pytest.approx(0.05)
    # An idle decode, but requests arrive at 1/s and a slow, idle prefill (100 tokens/s) would
    # give them their first token within the 0.8 s stall: 0.8 expected, so their gap counts
    # (0.05 + 0.8 / 4) and alone misses. P/D misses too (8 s to the first token): alone is
    # expected to cost 0.8 requests against the one P/D loses, so alone; at 2/s (1.6) P/D.
    # At 0.5/s (0.4 expected) alone meets.
    idle = _measured(1000.0, {1: 0.05})
    slow_prefill = [_measured(100.0)]
    decision = _decide(rule, 800, slow_prefill, [idle], max_tokens=4, arrivals=1.0)
    assert decision.predicted["itl_others_s"] == pytest.approx(0.05 + 0.8 / 4)
    assert (decision.mode, decision.reason) == (DECODE_ONLY, NEITHER_ALONE)
    decision = _decide(rule, 800, slow_prefill, [idle], max_tokens=4, arrivals=2.0)
    assert (decision.mode, decision.reason) == (DISAGGREGATED, NEITHER_PD)
    decision = _decide(rule, 800, slow_prefill, [idle], max_tokens=4, arrivals=0.5)
    assert (decision.reason, decision.predicted["itl_others_s"]) == (ALONE_MEETS, 0.0)
    # The arrivals split over the decodes: two idle ones halve each one's share.
    decision = _decide(rule, 800, slow_prefill, [idle, _measured(None)], 4, arrivals=1.2)
    assert decision.reason == ALONE_MEETS
    # Arrivals behind a long prefill queue (50 s) do not decode during the stall.
    decision = _decide(rule, 800, [_measured(100.0, queued=5000)], [idle], 4, arrivals=1.0)
    assert (decision.reason, decision.predicted["itl_others_s"]) == (ALONE_MEETS, 0.0)
    # Five requests decoding at 99 ms, the target 100 ms, behind a 20 s prefill queue: a
    # prompt alone adding 5 ms to their gap (0.5 s over 100 tokens) pushes about 5 / 20 of
    # them past the target (their gaps spread over a fifth of it): 1.25 requests, more than
    # P/D loses, so P/D; adding 2 ms (0.2 s) pushes 0.5 of them: alone.
    edge = _measured(1000.0, {5: 0.099})
    edge.service.decoding = 5
    queue = [_measured(1000.0, queued=20_000)]
    decision = _decide(rule, 500, queue, [edge], max_tokens=100)
    assert decision.predicted["itl_others_s"] == pytest.approx(0.104)
    assert decision.reason == NEITHER_PD
    assert _decide(rule, 200, queue, [edge], max_tokens=100).reason == NEITHER_ALONE
    # A decode whose own gap already misses the target: P/D is not predicted to meet it.
    laggard = _measured(1000.0, {1: 0.5})
    decision = _decide(rule, 10, [_measured(1000.0)], [laggard])
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.5)
    # Alone is no faster to the first token and has the same gap: stay P/D.
    assert decision.reason == NEITHER_PD
    # A decode that computed a prompt alone owes its requests that stall: spread over
    # max_tokens it is added to P/D's gap and to the others' gap after another alone prompt.
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stalled = _measured(None, {1: 0.05})
    ticket = stalled.service.prompt_started(1000)
    clock[0] = 100.4
    stalled.service.prompt_done(ticket)
    stalled.service.prompt_tokens_per_s = 1000.0
    busy_prefill = [_measured(1000.0, queued=5000)]
    decision = _decide(rule, 100, busy_prefill, [stalled], max_tokens=10)
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.05 + 0.4 / 10)
    # Requests decode there for 10 x 50 ms: a stall 0.6 s ago is behind all of them.
    clock[0] = 101.0
    later = _decide(rule, 100, busy_prefill, [stalled], max_tokens=10)
    assert later.predicted["itl_pd_s"] == pytest.approx(0.05)
    stalled.service.decoding = 1
    stalled.service.prompt_started(500)  # queued: 0.5 s at its 1000 tokens/s
    decision = _decide(rule, 100, busy_prefill, [stalled], max_tokens=10)
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.05 + 0.5 / 10)
    assert decision.predicted["itl_others_s"] == pytest.approx(0.05 + 0.5 / 10 + 0.1 / 10)
    # A prompt below the threshold goes alone before any prediction.
    floor = DisaggRule(threshold=64, slo=SLO)
    assert _decide(floor, 10, [busy], [crowded]).reason == BELOW_THRESHOLD


def _stalled_for(instance: _Instance, seconds: float, clock: list[float]) -> None:
    """``instance`` computed a prompt for ``seconds`` just now (the clock moves on; its
    prompt rate stays)."""
    rate = instance.service.prompt_tokens_per_s
    ticket = instance.service.prompt_started(1)
    clock[0] += seconds
    instance.service.prompt_done(ticket)
    instance.service.prompt_tokens_per_s = rate


@pytest.mark.unit
def test_a_prefill_alone_when_the_decodes_are_at_their_gap_target(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    rule = DisaggRule(slo=SLO)

    # Five requests decode at 90 ms (1: 50 ms), the target 100 ms: P/D's gap at batch 6 is
    # 100 ms (the last slope, 10 ms per request), within the target but not by the spread of
    # the requests' gaps (a fifth of it).
    def at_edge() -> _Instance:
        decode = _measured(None, {1: 0.05, 5: 0.09})
        decode.service.decoding = 5
        return decode

    # An idle prefill that never decoded is predicted to step as fast as the decodes, 50 ms at
    # batch 1, nothing of its time taken by prompts; a prediction alone takes no request P/D
    # would serve.
    prefill = _measured(1000.0)
    decision = _decide(rule, 500, [prefill], [at_edge()])
    assert decision.reason == PD_MEETS
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.1)
    assert decision.predicted["ttft_prefill_s"] == pytest.approx(0.5)
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.05)
    assert decision.predicted["itl_prefill_others_s"] == 0.0
    # What requests alone there got, 70 ms, is evidence: well within the target and below
    # P/D's gap, it takes the request.
    prefill.service.alone_decoded(0.07)
    decision = _decide(rule, 500, [prefill], [at_edge()])
    assert (decision.mode, decision.reason) == (PREFILL_ONLY, PREFILL_ALONE)
    assert decision.on_prefill and not decision.alone
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.07)
    # Well within the target, P/D stays, and nothing is predicted for a prefill alone.
    comfortable = _measured(None, {1: 0.05})
    decision = _decide(rule, 500, [prefill], [comfortable])
    assert decision.reason == PD_MEETS and "itl_prefill_s" not in decision.predicted
    # The prediction, which ranks the prefills: the prefill's own measured step wins over the
    # decodes'; a prefill that spent 4 of the last 10 s on prompts leaves a request 60% of its
    # steps (50 / 0.6); prompts queued there count (1000 tokens, 1 s more) and so do the ones
    # the router holds back (1 s of tokens at the prefills' rate).
    quick = _measured(1000.0, {1: 0.03})
    assert _decide(rule, 500, [quick], [at_edge()]).predicted["itl_prefill_s"] == 0.03
    busy = _measured(1000.0)
    _stalled_for(busy, 4.0, clock)
    decision = _decide(rule, 500, [busy], [at_edge()])
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.05 / 0.6)
    clock[0] += 10.0
    _stalled_for(busy, 3.0, clock)
    decision = _decide(rule, 500, [busy], [at_edge()])
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.05 / 0.7)
    held = _decide(rule, 500, [busy], [at_edge()], waiting=_Held((1000,)))
    assert held.predicted["itl_prefill_s"] == pytest.approx(0.05 / 0.6)
    busy.service.queued_prompt_tokens = 1000
    patient = DisaggRule(slo=SloTargets(ttft_s=2.0, itl_s=SLO.itl_s))
    decision = _decide(patient, 500, [busy], [at_edge()])
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.05 / 0.6)
    assert decision.predicted["ttft_prefill_s"] == pytest.approx(1.5)
    # A prefill all but full of prompts (95% of the window) is no candidate at all (and P/D
    # there would wait 10 s: the decode alone).
    full = _measured(1000.0, queued=9500)
    decision = _decide(rule, 500, [full], [at_edge()])
    assert decision.reason == ALONE_MEETS and "itl_prefill_s" not in decision.predicted
    # Its prompt stalls the requests decoding there: two at 40 ms, 500 tokens = 0.5 s over
    # 64 tokens each (48 ms) is within the target; over 4 tokens each it is not.
    decoding = _measured(1000.0, {1: 0.03, 2: 0.04})
    decoding.service.decoding = 2
    decoding.service.alone_decoded(0.04)
    decision = _decide(rule, 500, [decoding], [at_edge()])
    assert decision.predicted["itl_prefill_others_s"] == pytest.approx(0.04 + 0.5 / 64)
    assert decision.reason == PREFILL_ALONE
    decision = _decide(rule, 500, [decoding], [at_edge()], max_tokens=4)
    assert decision.predicted["itl_prefill_others_s"] == pytest.approx(0.04 + 0.5 / 4)
    assert decision.reason == PD_MEETS
    # Of two prefills, the one with the smaller gap of those whose first token meets the
    # target: not the quicker one 5 s away (500 tokens at 100/s).
    far = _measured(100.0, {1: 0.01})
    far.service.alone_decoded(0.01)
    decision = _decide(rule, 500, [far, prefill], [at_edge()])
    assert decision.reason == PREFILL_ALONE
    assert decision.predicted["ttft_prefill_s"] == pytest.approx(0.5)
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.07)
    with pytest.raises(ValueError, match="within_s must be > 0"):
        busy.service.busy_share(0.0)


@pytest.mark.unit
def test_what_requests_alone_on_a_prefill_got_replaces_the_prediction(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    rule = DisaggRule(slo=SLO)
    stats = ServiceStats()
    assert stats.alone_gap_s is None
    stats.alone_decoded(0.04)
    stats.alone_decoded(0.09)  # blended: 0.8 x 0.04 + 0.2 x 0.09
    stats.alone_decoded(float("nan"))
    stats.alone_decoded(-1.0)
    assert stats.alone_gap_s == pytest.approx(0.05)
    assert stats.describe()["alone_gap_s"] == pytest.approx(0.05)
    clock[0] += ALONE_MEMORY_S + 1  # forgotten: the load may have changed
    assert stats.alone_gap_s is None
    stats.alone_decoded(0.2)  # a fresh start, not blended with the forgotten one
    assert stats.alone_gap_s == pytest.approx(0.2)

    # P/D misses the 100 ms target (its gap at batch 6, 125 ms); so does the decode alone.
    def missing() -> _Instance:
        decode = _measured(None, {1: 0.05, 5: 0.11})
        decode.service.decoding = 5
        return decode

    # A prefill 80% busy with prompts is predicted 50 / 0.2 = 250 ms for a request alone;
    # not measured, idle of such requests, its steps alone meeting the target: tried, as a
    # request P/D loses anyway.
    busy = _measured(1000.0)
    _stalled_for(busy, 8.0, clock)
    decision = _decide(rule, 500, [busy], [missing()])
    assert decision.predicted["itl_pd_s"] == pytest.approx(0.125)
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.05 / 0.2)
    assert (decision.mode, decision.reason) == (PREFILL_ONLY, NEITHER_PREFILL)
    # One such request at a time: while one decodes there, not again.
    busy.service.decoding = 1
    assert _decide(rule, 500, [busy], [missing()]).reason == NEITHER_PD
    # Measured, what it got stands, whatever the prompts' share: 90 ms meets the target where
    # P/D does not (but is not well within it where P/D meets); 70 ms is well within it and
    # below P/D's gap; 150 ms misses.
    busy.service.decoding = 0
    busy.service.alone_decoded(0.09)
    decision = _decide(rule, 500, [busy], [missing()])
    assert decision.predicted["itl_prefill_s"] == pytest.approx(0.09)
    assert (decision.mode, decision.reason) == (PREFILL_ONLY, PREFILL_ALONE)
    edge = _measured(None, {1: 0.05, 5: 0.09})
    edge.service.decoding = 5
    assert _decide(rule, 500, [busy], [edge]).reason == PD_MEETS  # 90 ms: not well within
    clock[0] += ALONE_MEMORY_S + 1
    busy.service.alone_decoded(0.07)
    assert _decide(rule, 500, [busy], [edge]).reason == PREFILL_ALONE
    clock[0] += ALONE_MEMORY_S + 1
    busy.service.alone_decoded(0.15)
    assert _decide(rule, 500, [busy], [missing()]).reason == NEITHER_PD


@dataclass
class _Held:
    """Prompts the router holds back from busy prefills, as `prefill_order` reports them."""

    tokens: tuple[int, ...]

    @property
    def waiting_tokens(self) -> int:
        return sum(self.tokens)

    def tokens_ahead(self, tokens: int) -> int:
        return sum(t for t in self.tokens if t <= tokens)


@pytest.mark.unit
def test_a_pd_prompt_waits_for_the_held_back_prompts_sent_on_before_it():
    rule = DisaggRule(slo=SLO)
    decode = _measured(None, {1: 0.05})
    # 300 tokens queued at the prefill, 100 and 900 held back in the router: a 500-token
    # prompt follows the 100 (fewer tokens go first), not the 900: (300 + 100 + 500) / 1000.
    held = _Held((100, 900))
    decision = _decide(rule, 500, [_measured(1000.0, queued=300)], [decode], waiting=held)
    assert decision.predicted["ttft_pd_s"] == pytest.approx(0.9)
    assert decision.reason == PD_MEETS
    # A 50-token prompt follows none of them.
    decision = _decide(rule, 50, [_measured(1000.0, queued=300)], [decode], waiting=held)
    assert decision.predicted["ttft_pd_s"] == pytest.approx(0.35)
    # Waiting requests count as the prefills' queue where their share prefilled within a
    # stall is weighed: 0.5 s of stall computes 500 of 1300 tokens, so 2 waiting on the decode
    # count as 0.77; with nothing held back, all of the 300 queued: both count.
    waiting = _measured(1000.0, {1: 0.05, 2: 0.06})
    waiting.in_flight = 2
    busy = [_measured(1000.0, queued=300)]
    alone = _decide(rule, 500, busy, [waiting], max_tokens=4, waiting=_Held((1000,)))
    assert alone.predicted["itl_alone_s"] == pytest.approx(0.06)  # batch 1 + 1
    alone = _decide(rule, 500, busy, [waiting], max_tokens=4)
    assert alone.predicted["itl_alone_s"] == pytest.approx(0.07)  # batch 2 + 1


@pytest.mark.unit
def test_slo_targets_are_checked():
    with pytest.raises(ValueError, match="SLO itl_s must be > 0"):
        SloTargets(1.0, 0.0)
    base = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    for extra, message in [
        ({"slo_ttft_ms": 100}, "the SLO targets go together"),
        ({"slo_itl_ms": 50}, "the SLO targets go together"),
        ({"slo_ttft_ms": -1, "slo_itl_ms": 5}, "slo_ttft_ms must be a number >= 0"),
        ({"slo_ttft_ms": True, "slo_itl_ms": 5}, "slo_ttft_ms must be a number >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**base, **extra)
    rule = DisaggRule.of(RouterConfig(**base, slo_ttft_ms=500, slo_itl_ms=40))
    assert rule.slo == SloTargets(0.5, 0.04)


# ---------------------------------------------------------------------- with real daemons


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    logs = tmp_path_factory.mktemp("slo")
    prefill = start_daemon("prefill", logs, "--engine-id", "p")
    decode = start_daemon("decode", logs, "--engine-id", "d")
    with running(decode, prefill):
        yield prefill, decode
    assert exit_used_blocks(prefill) == exit_used_blocks(decode) == 0


def _generous_slos(prefill, decode, **extra: Any) -> RouterConfig:
    """A router in front of the two daemons with targets every route meets when idle."""
    return RouterConfig(
        (prefill.address,),
        (decode.address,),
        slo_ttft_ms=60_000,
        slo_itl_ms=10_000,
        shutdown_timeout_s=5.0,
        **extra,
    )


@pytest.mark.integration
def test_each_route_is_taken_when_its_condition_holds_and_equals_colocated(daemons):
    prefill, decode = daemons
    prompt = list(PROMPTS[2].encode())
    (expected,) = colocated([prompt], MAX_TOKENS)

    async def scenario() -> None:
        config = _generous_slos(prefill, decode, kv_stream="always")
        async with (
            RouterServer(config) as router,
            aiohttp.ClientSession(base_url=router.url) as http,
        ):
            fleet = router.handlers.fleet
            p, d = fleet.get(prefill.address), fleet.get(decode.address)

            async def routed(stream: bool = False) -> dict[str, Any]:
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
                async with http.post("/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    if stream:
                        events = (await response.text()).split("\n\n")
                        info = json.loads(events[-3].removeprefix("data: "))["kvtransfer"]
                    else:
                        info = (await response.json())["kvtransfer"]
                assert info["token_ids"] == expected
                return info

            # Nothing measured yet: disaggregated, and the calls are measured.
            first = await routed()
            assert first["route_decision"]["reason"] == NO_PROFILE
            assert first["prefill"] == prefill.address
            assert p.service.prompt_tokens_per_s and p.service.prompt_tokens_per_s > 0
            assert d.service.inter_token_s(1) is not None
            assert (p.service.queued_prompt_tokens, d.service.decoding) == (0, 0)
            # Measured, and generous targets: P/D meets them.
            second = await routed(stream=True)
            assert second["route_decision"]["reason"] == PD_MEETS
            assert second["route_decision"]["uncached_tokens"] == len(prompt)
            assert second["prefill"] == prefill.address
            # Five requests decoding at 11 s a token, the target 10 s: P/D misses it, and so
            # does the decode alone. The idle prefill, where no request alone was measured yet
            # and whose steps (taken as the decode's at batch 1) would meet it, is tried; then
            # the gap that request got there meets the target: the next one goes there too.
            d.service.decoding = 5
            d.service.token_gap(11.0, 1)
            for reason in (NEITHER_PREFILL, PREFILL_ALONE):
                on_prefill = await routed(stream=True)
                assert on_prefill["route_decision"]["reason"] == reason, on_prefill
                assert on_prefill["prefill"] == prefill.address and "decode" not in on_prefill
                assert on_prefill["kv_blocks_received"] == 0
                # It measured the prefill's steps, and the gap a request alone there got.
                assert p.service.inter_token_s(1) is not None
                assert p.service.alone_gap_s is not None
            d.service.decoding = 0
            # A prefill with a backlog far past the TTFT target: the decode alone.
            p.service.queued_prompt_tokens = 10**12
            alone = await routed()
            assert alone["route_decision"]["reason"] == ALONE_MEETS, alone["route_decision"]
            assert "prefill" not in alone and alone["decode"] == decode.address
            assert alone["kv_blocks_received"] == 0
            assert d.service.prompt_tokens_per_s and d.service.prompt_tokens_per_s > 0
            # ... unless the decode, with a queue of prompts of its own ten times the
            # prefill's, would be slower still (both miss: P/D, the sooner first token).
            d.service.decoding = 3
            d.service.queued_prompt_tokens = 10**13
            stalled = await routed(stream=True)
            assert stalled["route_decision"]["reason"] == NEITHER_PD, stalled["route_decision"]
            assert stalled["prefill"] == prefill.address
            p.service.queued_prompt_tokens = d.service.queued_prompt_tokens = 0
            d.service.decoding = 0
            async with http.get("/metrics") as response:
                metrics = await response.text()
            for mode, reason in [
                (DISAGGREGATED, NO_PROFILE),
                (DISAGGREGATED, PD_MEETS),
                (PREFILL_ONLY, NEITHER_PREFILL),
                (PREFILL_ONLY, PREFILL_ALONE),
                (DECODE_ONLY, ALONE_MEETS),
                (DISAGGREGATED, NEITHER_PD),
            ]:
                line = (
                    f'kvtransfer_router_route_decisions_total{{mode="{mode}",reason="{reason}"}} '
                    "1.0"
                )
                assert line in metrics.splitlines(), line

    asyncio.run(asyncio.wait_for(scenario(), 300))


@pytest.mark.integration
def test_held_back_at_busy_prefills_the_shorter_prompt_goes_first_and_equals_colocated(daemons):
    """Both prefill turns taken (as if two prompts computed there): two requests wait in the
    router; as turns free, the one with fewer tokens is sent on first, though it came last."""
    prefill, decode = daemons
    long_prompt, short_prompt = list(PROMPTS[2].encode()), list(PROMPTS[1].encode())
    expected = colocated([long_prompt, short_prompt], MAX_TOKENS)

    async def scenario() -> None:
        config = _generous_slos(prefill, decode)
        async with (
            RouterServer(config) as router,
            aiohttp.ClientSession(base_url=router.url) as http,
        ):
            order = router.handlers.runner.decider.order
            assert order is not None

            async def routed(prompt: list[int]) -> dict[str, Any]:
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS}
                async with http.post("/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    return (await response.json())["kvtransfer"]

            # One request first, so the prefill's rate is measured (the order then predicts).
            await routed(short_prompt)
            held = [asyncio.Event(), asyncio.Event()]
            entered = asyncio.Event()

            async def hold(event: asyncio.Event) -> None:
                async with order.turn(1, time.monotonic(), time.monotonic() + 60, 2, lambda n: 0):
                    if order.inside == 2:
                        entered.set()
                    await event.wait()

            holders = [asyncio.create_task(hold(event)) for event in held]
            await entered.wait()
            long_answer = asyncio.create_task(routed(long_prompt))
            while order.waiting < 1:
                await asyncio.sleep(0.01)
            short_answer = asyncio.create_task(routed(short_prompt))
            while order.waiting < 2:
                await asyncio.sleep(0.01)
            assert order.waiting_tokens == len(long_prompt) + len(short_prompt)
            held[0].set()
            short = await short_answer
            assert not long_answer.done()  # still waiting: one turn is held
            held[1].set()
            longer = await long_answer
            await asyncio.gather(*holders)
            assert [longer["token_ids"], short["token_ids"]] == expected
            assert (order.inside, order.waiting) == (0, 0)
            async with http.get("/metrics") as response:
                metrics = await response.text()
            for how, count in [("at_once", 1), ("in_time", 2)]:
                line = f'kvtransfer_router_prefill_wait_seconds_count{{order="{how}"}} {count}.0'
                assert line in metrics.splitlines(), line
            assert 'kvtransfer_router_prefill_turns{state="waiting"} 0.0' in metrics

    asyncio.run(asyncio.wait_for(scenario(), 300))
