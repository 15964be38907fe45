"""The fleet page's data in one process (no daemon, no server, no browser): the JSON of
``/dashboard/state`` and ``/dashboard/requests/{id}``, the ring of recent requests and its
bounds, the page's routes (and ``--no-dashboard``), and what the page is served with. In a real
browser against real daemons: tests/test_router_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import re
from importlib import resources
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvtransfer.router.__main__ import _parser, config_from_args
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.exchange import Delta
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import ADMIN
from kvtransfer.router.routing.policy import InstanceLoad, RoundRobin, create_policy
from kvtransfer.router.web.admission import Admission
from kvtransfer.router.web.app import ROUTER, make_app
from kvtransfer.router.web.fleet_page import FleetPage
from kvtransfer.router.web.recent import MAX_TIMELINE_ROWS, RecentRequests, choice_summary

pytestmark = pytest.mark.unit

P, D, A = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"
CONFIG = RouterConfig(prefill=(P,), decode=(D,), admin_token="t0ken", policy="round_robin")


def row(name: str, start_ms: float = 0.0, duration_ms: float = 1.0, **attributes: Any):
    found: dict[str, Any] = {"name": name, "start_ms": start_ms, "duration_ms": duration_ms}
    if attributes:
        found["attributes"] = attributes
    return found


def last_delta(request_id: str, index: int = 0, timeline=(), **info: Any) -> Delta:
    return Delta(
        index=index,
        finish_reason="length",
        info={"request_id": request_id, "timeline": list(timeline), **info},
        num_prompt_tokens=7,
    )


def pd_delta(request_id: str) -> Delta:
    return last_delta(request_id, timeline=PD_TIMELINE, prefill=P, decode=D)


PD_TIMELINE = [
    row("router.parse"),
    row("router.pick", role="decode"),
    row("router.pick", role="prefill"),
    row("router.prefill_call", 1.0, 5.0, instance=P, kv_stream=True),
    row("prefill.engine.compute", 2.0, 3.0, prompt_tokens=7),
    row("decode.kv.read", 4.0, 1.0, bytes=4096),
]


# ---------------------------------------------------------------------- the recent requests


def test_the_ring_keeps_the_last_requests_newest_first():
    recent = RecentRequests(3)
    for n in range(5):
        recent.finished(f"cmpl-{n}", "/v1/completions", 1000.0 + n, "builtin", 200, 2.5)
    assert [s.request_id for s in recent.newest_first()] == ["cmpl-4", "cmpl-3", "cmpl-2"]
    assert recent.get("cmpl-1") is None
    assert recent.get("cmpl-3").arrived_unix_ms == 1003.0
    for bad in (0, -1, True, "3"):
        expected = f"capacity must be an integer >= 1, got {bad!r}"
        with pytest.raises(ValueError, match=re.escape(expected)):
            RecentRequests(bad)


def test_a_choice_waits_for_its_requests_status_and_no_entry_outlives_it():
    recent = RecentRequests(4)
    recent.choice_ended("cmpl-x", last_delta("cmpl-x-1", 1, token_ids=[1, 2]))
    recent.choice_ended("cmpl-x", last_delta("cmpl-x-0", 0, token_ids=[3]))
    recent.choice_ended("cmpl-x", Delta(index=2, finish_reason="length"))  # no kvtransfer object
    assert recent.in_flight == 1
    summary = recent.finished("cmpl-x", "/v1/chat/completions", 5.0, "builtin", 200, 9.0)
    assert recent.in_flight == 0
    assert [c.request_id for c in summary.choices] == ["cmpl-x-0", "cmpl-x-1"]
    assert summary.brief()["completion_tokens"] == 3
    refused = recent.finished("cmpl-y", "/v1/completions", 6.0, "builtin", 400, 0.5, "prompt: bad")
    assert refused.brief() == {
        "request_id": "cmpl-y",
        "path": "/v1/completions",
        "arrived_unix_ms": 6.0,
        "model": "builtin",
        "status": 400,
        "duration_ms": 0.5,
        "error": "prompt: bad",
        "stream_failed": False,
        "timelines_kept": True,
        "prompt_tokens": None,
        "completion_tokens": 0,
        "choices": [],
    }


def test_a_choices_route_retries_and_kv_stream_come_from_its_answer():
    pd = choice_summary(
        last_delta(
            "cmpl-a",
            timeline=[*PD_TIMELINE, row("router.pick", role="prefill")],
            prefill=P,
            decode=D,
            token_ids=[5, 6, 7],
            ttft_s=0.0123,
            kv_blocks_received=3,
        )
    )
    assert pd.brief() == {
        "request_id": "cmpl-a",
        "index": 0,
        "prefill": P,
        "decode": D,
        "kv_stream": True,
        # Two prefill picks, one decode pick: the second prefill pick was a retry.
        "retries": 1,
        "ttft_ms": 12.3,
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "kv_blocks_received": 3,
        "timeline_spans": 7,
    }
    assert pd.detail()["timeline"] == [*PD_TIMELINE, row("router.pick", role="prefill")]
    alone = choice_summary(
        last_delta("cmpl-b", timeline=[row("router.pick", role="decode")], decode=D, ttft_s=None)
    )
    assert (alone.prefill, alone.decode, alone.kv_stream, alone.retries, alone.ttft_ms) == (
        None,
        D,
        None,
        0,
        None,
    )


def test_a_requests_timeline_rows_are_bounded_over_its_choices():
    recent = RecentRequests(2)
    many = [row("decode.engine.step", float(n)) for n in range(MAX_TIMELINE_ROWS - 1)]
    recent.choice_ended("cmpl-z", last_delta("cmpl-z-0", 0, many))
    recent.choice_ended("cmpl-z", last_delta("cmpl-z-1", 1, PD_TIMELINE[:5]))
    first, second = recent.finished("cmpl-z", "/v1/completions", 1.0, "m", 200, 1.0).choices
    assert (len(first.timeline), first.timeline_rows_dropped) == (MAX_TIMELINE_ROWS - 1, 0)
    assert second.detail()["timeline"] == PD_TIMELINE[:1]
    assert (second.timeline_rows_dropped, second.brief()["timeline_spans"]) == (4, 5)


# ---------------------------------------------------------------------- the state


def fleet_and_page(recent: RecentRequests, config: RouterConfig = CONFIG):
    """A fleet of three (a prefill, an admin-added decode, an aggregated one) under a
    cache-aware decode policy whose index learned one prompt on the decode."""
    decode_policy = create_policy("cache_aware", "decode", config)
    fleet = Fleet({"prefill": RoundRobin(), "decode": decode_policy})
    prefill, decode, aggregated = (
        fleet.add("prefill", P),
        fleet.add("decode", D, ADMIN),
        fleet.add("aggregated", A),
    )
    for instance in (prefill, decode):
        instance.health.healthy, instance.health.state = True, "SERVING"
    aggregated.health.state = "UNREACHABLE (UNAVAILABLE)"
    prefill.picks, prefill.in_flight = 3, 1
    prefill.load = InstanceLoad(running=2, waiting=1, kv_blocks_used=10, kv_blocks_total=96)
    prefill.uptime_s = 12.5
    decode.failed()
    decode.failed()
    decode.load_problem = "UNIMPLEMENTED"
    for address in (D, A):
        decode_policy.index.add_instance(address, block_size=4)
    decode_policy.index.observe(D, list(range(10)))
    admission = Admission(8, 16)
    clock = iter([100.0, 102.5]).__next__
    return fleet, FleetPage(config, lambda: fleet, admission, recent, clock=clock)


def instance(address: str, role: str, **fields: Any) -> dict[str, Any]:
    return {
        "address": address,
        "role": role,
        "source": "static",
        "state": "SERVING",
        "healthy": True,
        "breaker": "closed",
        "pickable": True,
        "in_flight": 0,
        "picks": 0,
        "load": None,
        "service": {
            "prompt_tokens_per_s": None,
            "queued_prompt_tokens": 0,
            "decoding": 0,
            "server_running": 0,
            "itl_source": "router",
            "inter_token_s_by_batch": {},
            "alone_gap_s": None,
        },
        "consecutive_failures": 0,
        "load_problem": None,
        "uptime_s": None,
        "index": None,
        **fields,
    }


def index(blocks: int) -> dict[str, Any]:
    return {
        "mode": "approximate",
        "blocks": blocks,
        "events_blocks": 0,
        "routed_blocks": blocks,
        "pending_blocks": 0,
        "block_size": 4,
    }


def body_of(response: web.StreamResponse) -> Any:
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    return json.loads(response.body)


def test_the_state_holds_the_router_the_instances_by_role_and_the_last_requests():
    async def scenario():
        recent = RecentRequests(5)
        recent.choice_ended("cmpl-1", pd_delta("cmpl-1"))
        recent.finished("cmpl-1", "/v1/completions", 1.0, "builtin", 200, 8.0)
        recent.finished("cmpl-2", "/v1/completions", 2.0, "builtin", 503, 1.0, "no prefill")
        fleet, page = fleet_and_page(recent)
        try:
            response = await page.state(make_mocked_request("GET", "/dashboard/state"))
        finally:
            await fleet.close()
        assert response.headers["Cache-Control"] == "no-store"
        return body_of(response)

    state = asyncio.run(scenario())
    assert state["router"] == {
        "model": "builtin",
        "engine": "kvtransfer",
        "uptime_s": 2.5,
        "running": 0,
        "queued": 0,
        "max_running": 8,
        "max_queued": 16,
        "policies": {"prefill": "round_robin", "decode": "cache_aware"},
        "admin_api": True,
        "recent_capacity": 5,
    }
    load = {"running": 2, "waiting": 1, "kv_blocks_used": 10, "kv_blocks_total": 96}
    assert state["instances"] == {
        "prefill": [
            instance(P, "prefill", in_flight=1, picks=3, load=load, uptime_s=12.5),
        ],
        "decode": [
            instance(
                D,
                "decode",
                source="admin",
                consecutive_failures=2,
                load_problem="UNIMPLEMENTED",
                index=index(2),  # 10 tokens: two full blocks of 4
            )
        ],
        "aggregated": [
            instance(
                A,
                "aggregated",
                state="UNREACHABLE (UNAVAILABLE)",
                healthy=False,
                pickable=False,
                index=index(0),
            )
        ],
    }
    assert [r["request_id"] for r in state["requests"]] == ["cmpl-2", "cmpl-1"]
    assert state["requests"][0]["error"] == "no prefill"
    # The state lists the requests without their timelines (a count instead).
    assert state["requests"][1]["choices"][0]["timeline_spans"] == len(PD_TIMELINE)
    assert "timeline" not in state["requests"][1]["choices"][0]


def test_one_recent_request_comes_with_its_timeline_or_404_naming_the_ring():
    async def scenario():
        recent = RecentRequests(2)
        recent.choice_ended("cmpl-1", pd_delta("cmpl-1"))
        recent.finished("cmpl-1", "/v1/completions", 1.0, "builtin", 200, 8.0)
        fleet, page = fleet_and_page(recent)
        try:
            found = await page.request(
                make_mocked_request("GET", "/x", match_info={"request_id": "cmpl-1"})
            )
            missing = await page.request(
                make_mocked_request("GET", "/x", match_info={"request_id": "cmpl-0"})
            )
        finally:
            await fleet.close()
        return found, missing

    found, missing = asyncio.run(scenario())
    assert body_of(found)["choices"][0]["timeline"] == PD_TIMELINE
    assert missing.status == 404
    assert body_of(missing)["error"] == {
        "message": "cmpl-0 is not among the last 2 requests this router answered",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_not_found",
    }


# ---------------------------------------------------------------------- the page and its routes


def routes(config: RouterConfig) -> set[str]:
    return {r.canonical for r in make_app(config).router.resources()}


def test_the_page_is_served_unless_turned_off():
    page_routes = {
        "/dashboard",
        "/dashboard/fleet.js",
        "/dashboard/fleet.css",
        "/dashboard/state",
        "/dashboard/requests/{request_id}",
    }
    assert page_routes <= routes(CONFIG)
    off = RouterConfig(prefill=(P,), decode=(D,), dashboard=False)
    assert not {r for r in routes(off) if r.startswith("/dashboard")}
    # Nor is any request recorded for it.
    assert make_app(off)[ROUTER].recent is None
    assert make_app(CONFIG)[ROUTER].recent is not None
    args = ["--prefill", P, "--decode", D]
    assert config_from_args(_parser().parse_args(args), {}).dashboard is True
    assert config_from_args(_parser().parse_args([*args, "--no-dashboard"]), {}).dashboard is False


def test_the_page_runs_only_its_own_script_and_writes_fleet_strings_as_text():
    async def scenario():
        fleet, page = fleet_and_page(RecentRequests(1))
        app = web.Application()
        page.add_routes(app)
        try:
            answers = {}
            for path in ("/dashboard", "/dashboard/fleet.js", "/dashboard/fleet.css"):
                match = await app.router.resolve(make_mocked_request("GET", path))
                answers[path] = await match.handler(make_mocked_request("GET", path))
        finally:
            await fleet.close()
        return answers

    answers = asyncio.run(scenario())
    types = {path: a.headers["Content-Type"] for path, a in answers.items()}
    assert types == {
        "/dashboard": "text/html; charset=utf-8",
        "/dashboard/fleet.js": "text/javascript; charset=utf-8",
        "/dashboard/fleet.css": "text/css; charset=utf-8",
    }
    policy = answers["/dashboard"].headers["Content-Security-Policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "frame-ancestors 'none'"):
        assert directive in policy
    assert answers["/dashboard"].headers["X-Content-Type-Options"] == "nosniff"
    static = resources.files("kvtransfer.router.web").joinpath("static")
    html = static.joinpath("fleet.html").read_text()
    # Every script is a file of the page's own (the policy refuses inline ones).
    assert re.findall(r"<script[^>]*>", html) == ['<script src="dashboard/fleet.js" defer>']
    assert not re.search(r"\son\w+=", html)
    script = static.joinpath("fleet.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script
