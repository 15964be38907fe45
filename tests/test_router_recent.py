"""The fleet page's record of requests (`recent.RecentRequests`) against what others write
into it: bounded in bytes, not only in rows (errors cut, timelines kept for the newest requests
only, each row sanitised); a failed stream recorded as failed; and its bookkeeping never failing
a request. In one process: the router's handlers with a stand-in for the layer below them (the
choice runner), no daemon, no server. The page's JSON and routes: test_router_fleet_state.py."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.exchange import Delta, Exchange
from kvtransfer.router.errors import FailedAnswer, UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.routing.policy import RoundRobin
from kvtransfer.router.vllm_flow.answers import passed_through
from kvtransfer.router.web.answers import AnswerWriter
from kvtransfer.router.web.app import RouterHandlers
from kvtransfer.router.web.http_errors import error_response
from kvtransfer.router.web.recent import (
    DETAILED_REQUESTS,
    MAX_ATTRIBUTES,
    MAX_ERROR_CHARS,
    MAX_TIMELINE_CHARS,
    MAX_TIMELINE_ROWS,
    MAX_VALUE_CHARS,
    RecentRequests,
    answer_failure,
    choice_summary,
    row_chars,
    timeline_row,
)

pytestmark = pytest.mark.unit

P, D = "127.0.0.1:1001", "127.0.0.1:1002"
CONFIG = RouterConfig(prefill=(P,), decode=(D,))
LOGGER = "kvtransfer.router.dashboard"


def last_delta(request_id: str, timeline: list[Any], index: int = 0) -> Delta:
    info = {"request_id": request_id, "timeline": timeline, "prefill": P, "decode": D}
    return Delta(index=index, finish_reason="length", info=info, num_prompt_tokens=3)


def strict_json(raw: bytes) -> Any:
    """JSON as a browser's ``JSON.parse`` reads it: no NaN, no Infinity."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


# ---------------------------------------------------------------------- bounded in bytes


def test_an_error_is_kept_cut():
    recent = RecentRequests(2)
    huge = "model '" + "x" * (8 << 20) + "' does not exist"
    kept = recent.finished("cmpl-1", "/v1/completions", 1.0, "m", 404, 1.0, huge).error
    assert kept == huge[:MAX_ERROR_CHARS] + "…"
    short = recent.finished("cmpl-2", "/v1/completions", 1.0, "m", 400, 1.0, "prompt: bad")
    assert short.error == "prompt: bad"


def test_only_the_newest_requests_keep_their_timelines():
    recent = RecentRequests(50)
    rows = [{"name": "router.pick", "start_ms": 0.0, "duration_ms": 1.0}] * 3
    for n in range(DETAILED_REQUESTS + 2):
        recent.choice_ended(f"cmpl-{n}", last_delta(f"cmpl-{n}", rows))
        recent.finished(f"cmpl-{n}", "/v1/completions", float(n), "m", 200, 1.0)
    kept = [s.timelines_kept for s in recent.newest_first()]
    assert kept == [True] * DETAILED_REQUESTS + [False, False]
    oldest = recent.get("cmpl-0")
    assert oldest is not None
    detail = strict_json(oldest.detail_json)
    assert (detail["timelines_kept"], detail["choices"][0]["timeline"]) == (False, [])
    # Its counts stay: the list shows how many spans it had.
    assert detail["choices"][0]["timeline_rows_dropped"] == 3
    assert oldest.brief()["choices"][0]["timeline_spans"] == 3
    newest = recent.get(f"cmpl-{DETAILED_REQUESTS + 1}")
    assert newest is not None and len(newest.choices[0].timeline) == 3


def test_a_requests_rows_are_bounded_in_count_and_in_size():
    recent = RecentRequests(1)
    step = {"name": "decode.engine.step", "start_ms": 0.0, "duration_ms": 1.0}
    recent.choice_ended("cmpl-a", last_delta("cmpl-a", [step] * (MAX_TIMELINE_ROWS + 5)))
    (choice,) = recent.finished("cmpl-a", "/v1/completions", 1.0, "m", 200, 1.0).choices
    assert (len(choice.timeline), choice.timeline_rows_dropped) == (MAX_TIMELINE_ROWS, 5)
    # Rows as large as a row may be: the size bound comes first.
    big = {
        "name": "n" * 1000,
        "start_ms": 0.0,
        "duration_ms": 1.0,
        "attributes": {f"{k}{'k' * 100}": "v" * 10_000 for k in range(MAX_ATTRIBUTES)},
    }
    recent.choice_ended("cmpl-b", last_delta("cmpl-b", [big] * 400, 0))
    recent.choice_ended("cmpl-b", last_delta("cmpl-b-1", [big] * 400, 1))
    summary = recent.finished("cmpl-b", "/v1/completions", 1.0, "m", 200, 1.0)
    kept = [row for choice in summary.choices for row in choice.timeline]
    size = sum(map(row_chars, kept))
    assert size <= MAX_TIMELINE_CHARS < size + row_chars(kept[0])
    assert sum(c.timeline_rows_dropped for c in summary.choices) == 800 - len(kept)
    # The estimate holds the JSON's size from above.
    assert len(json.dumps(kept)) <= size


def test_timeline_rows_are_stored_sanitised():
    attributes = {
        "role": "decode",
        "bytes": 4096,
        "ratio": 0.5,
        "kv_stream": True,
        "none": None,
        "nan": math.nan,
        "inf": -math.inf,
        "list": [1, 2],
        "object": {"a": 1},
        "huge_int": 10**30,
        "long": "s" * 1000,
        "ninth": 9,
    }
    row = {"name": "router.pick", "start_ms": 1, "duration_ms": 0.5, "attributes": attributes}
    assert timeline_row({**row, "extra": "dropped"}) == {
        "name": "router.pick",
        "start_ms": 1,
        "duration_ms": 0.5,
        "attributes": {
            "role": "decode",
            "bytes": 4096,
            "ratio": 0.5,
            "kv_stream": True,
            "none": None,
            "nan": None,
            "inf": None,
            "list": None,
        },
    }
    long_only = timeline_row({**row, "attributes": {"k" * 100: "s" * 1000}})
    assert long_only == {
        **row,
        "attributes": {"k" * 64 + "…": "s" * MAX_VALUE_CHARS + "…"},
    }
    # Not rows: dropped, and counted as such.
    for bad in (
        "router.pick",
        {"start_ms": 0.0, "duration_ms": 1.0},
        {"name": 5, "start_ms": 0.0, "duration_ms": 1.0},
        {"name": "x", "start_ms": math.nan, "duration_ms": 1.0},
        {"name": "x", "start_ms": 0.0, "duration_ms": math.inf},
        {"name": "x", "start_ms": True, "duration_ms": 1.0},
        {"name": "x", "start_ms": 10**400, "duration_ms": 1.0},
    ):
        assert timeline_row(bad) is None, bad
    # A daemon's odd attribute (unhashable, NaN) neither breaks the summary nor its JSON.
    odd = [
        {"name": "router.pick", "start_ms": 0.0, "duration_ms": 1.0, "attributes": {"role": []}},
        {"name": "router.pick", "start_ms": 0.0, "duration_ms": 1.0, "attributes": {"role": {}}},
        {"name": "decode.x", "start_ms": 0.0, "duration_ms": 1.0, "attributes": {"v": math.nan}},
        "not a row",
    ]
    summary = choice_summary(last_delta("cmpl-o", odd))
    assert (summary.retries, summary.timeline_rows_dropped, len(summary.timeline)) == (1, 1, 3)
    recent = RecentRequests(1)
    recent.choice_ended("cmpl-o", last_delta("cmpl-o", odd))
    finished = recent.finished("cmpl-o", "/v1/completions", 1.0, "m", 200, 1.0)
    assert strict_json(finished.detail_json)["choices"][0]["timeline"][2]["attributes"] == {
        "v": None
    }
    # Serialised once: the page asks for the newest request's detail at every change.
    assert finished.detail_json is finished.detail_json


# ---------------------------------------------------------------------- what an answer records


def test_what_a_failed_answer_records():
    rid = "cmpl-1"
    assert answer_failure(error_response(rid, 503, "no healthy decode daemon")) == FailedAnswer(
        "no healthy decode daemon"
    )
    # vLLM's refusal goes to the client as it came; the record names who refused, no more: its
    # body is vLLM's (up to megabytes, echoing the input), and may nest past any parser.
    nested = b'{"error": ' * 100_000 + b"1" + b"}" * 100_000
    large = json.dumps({"error": {"message": "x" * (1 << 20)}}).encode()

    async def scenario() -> list[web.Response]:
        fleet = Fleet({"prefill": RoundRobin(), "decode": RoundRobin()})
        prefill, decode = fleet.add("prefill", P), fleet.add("decode", D)
        try:
            return [
                passed_through(prefill, rid, 400, nested, {}),
                passed_through(decode, rid, 422, large, {}),
                passed_through(decode, rid, 200, b"{}", {}),
            ]
        finally:
            await fleet.close()

    refused, unprocessable, answered = asyncio.run(scenario())
    assert (refused.body, unprocessable.body) == (nested, large)
    assert answer_failure(refused) == FailedAnswer(
        f"prefill daemon {P} refused the request (HTTP 400); its answer went to the client as "
        "vLLM wrote it"
    )
    assert answer_failure(unprocessable) == FailedAnswer(
        f"decode daemon {D} refused the request (HTTP 422); its answer went to the client as "
        "vLLM wrote it"
    )
    assert answer_failure(answered) is None
    # An answer the router did not mark is not read.
    assert answer_failure(web.Response(status=400, body=nested)) is None
    assert answer_failure(web.json_response({"ok": True})) is None
    assert answer_failure(None) is None


# ---------------------------------------------------------------------- through the handlers


class Body:
    """A request body as aiohttp's request reads it (``make_mocked_request`` has none)."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def set_read_chunk_size(self, size: int) -> None:
        pass

    async def readany(self) -> bytes:
        raw, self._raw = self._raw, b""
        return raw


class Runner:
    """The choice runner, one layer down: one choice's deltas, then ``failure`` if any."""

    def __init__(self, deltas: list[Delta], failure: Exception | None = None) -> None:
        self.deltas = deltas
        self.failure = failure

    async def run(self, exchange: Exchange) -> AsyncIterator[Delta]:
        for delta in self.deltas:
            yield delta
        if self.failure is not None:
            raise self.failure


def post(body: dict[str, Any]) -> web.Request:
    raw = json.dumps(body).encode()
    return make_mocked_request("POST", "/v1/completions", payload=Body(raw))


def handlers_on(runner: Runner, config: RouterConfig = CONFIG) -> RouterHandlers:
    handlers = RouterHandlers(config)
    recent = handlers.recent
    handlers.answers = AnswerWriter(
        handlers.metrics, lambda: runner, None if recent is None else recent.choice_ended
    )
    return handlers


def only_summary(handlers: RouterHandlers) -> dict[str, Any]:
    assert handlers.recent is not None
    (summary,) = handlers.recent.newest_first()
    return summary.brief()


def test_a_stream_that_fails_after_its_first_bytes_is_recorded_as_failed():
    cut = UpstreamError(502, "its answer was cut: reset", "decode", D, "cut")
    handlers = handlers_on(Runner([Delta(index=0, text="Hel", token_ids=(1,))], cut))

    async def scenario() -> web.StreamResponse:
        return await handlers.completions(post({"prompt": "x", "max_tokens": 4, "stream": True}))

    response = asyncio.run(scenario())
    assert (response.status, response.prepared) == (200, True)
    summary = only_summary(handlers)
    assert (summary["status"], summary["stream_failed"], summary["error"]) == (
        200,
        True,
        f"decode daemon {D}: its answer was cut: reset",
    )


def test_a_request_that_failed_before_its_answer_records_the_routers_message_cut():
    handlers = handlers_on(Runner([]))

    async def scenario() -> web.StreamResponse:
        return await handlers.completions(post({"prompt": "x", "model": "<img>" * 100_000}))

    response = asyncio.run(scenario())
    assert response.status == 404
    summary = only_summary(handlers)
    quoted = "'" + ("<img>" * 20) + "'…"
    assert (summary["status"], summary["stream_failed"], summary["error"]) == (
        404,
        False,
        f"model {quoted} does not exist (this router serves 'builtin')",
    )


def test_the_pages_bookkeeping_never_fails_a_request(monkeypatch, caplog):
    last = Delta(index=0, text="hi", token_ids=(1, 2), finish_reason="length", info={})
    runner = Runner([last])
    handlers = handlers_on(runner)
    assert handlers.recent is not None

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    # The choice's summary and the request's summary both raise.
    monkeypatch.setattr(handlers.recent, "choice_ended", broken)
    monkeypatch.setattr(handlers.recent, "finished", broken)
    handlers.answers = AnswerWriter(handlers.metrics, lambda: runner, handlers.recent.choice_ended)

    async def scenario() -> list[web.StreamResponse]:
        return [
            await handlers.completions(post({"prompt": "x", "max_tokens": 2})),
            await handlers.completions(post({"prompt": "x", "max_tokens": 2})),
            await handlers.completions(post({"prompt": "x", "model": "other"})),
        ]

    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        answers = asyncio.run(scenario())
    assert [a.status for a in answers] == [200, 200, 404]
    first = answers[0]
    assert isinstance(first, web.Response) and isinstance(first.body, bytes)
    assert json.loads(first.body)["choices"][0]["text"] == "hi"
    logged = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records]
    # Each hook's first failure once with its traceback, the rest at debug.
    assert logged == [
        ("WARNING", "fleet page: a choice's summary failed"),
        ("WARNING", "fleet page: a request's summary failed"),
        ("DEBUG", "fleet page: a choice's summary failed"),
        ("DEBUG", "fleet page: a request's summary failed"),
        ("DEBUG", "fleet page: a request's summary failed"),
    ]
    assert all(r.exc_info is not None for r in caplog.records)
