"""The router in front of vLLM servers (``engine="vllm"``) against adversarial clients and
misbehaving upstreams (`router_helpers.fake_vllm` stand-ins answering what no good vLLM server
would): every failure is a typed OpenAI error naming the problem, and whatever the request held
(its admission slot, its leases, its upstream connections) is freed. Nothing here is timed: a
hang shows as the scenario's safety-net timeout."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from router_helpers.cluster import ADMIN_TOKEN, WAIT_S, run, sse_events
from router_helpers.fake_vllm import (
    DECODE_JSON,
    PARAMS,
    SSE_CHUNKS,
    SSE_DONE,
    FakeVllm,
    Handler,
    VllmBehaviour,
    decode_answering_usage,
    decode_ok,
    prefill_ok,
    vllm_metrics,
)
from router_helpers.vllm_cluster import VllmCluster, decode, prefill, vllm_cluster
from waiting import wait_until_async

from kvtransfer.router.fleet import vllm_endpoint
from kvtransfer.router.fleet.vllm_endpoint import KV_USAGE_SCALE, parse_vllm_metrics
from kvtransfer.router.vllm_flow import proxy as vllm_proxy

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# The deadline of the requests meant to outlast it: long enough for the steps before the hang
# on a busy machine (the error must name the instance that hung), short for the suite.
DEADLINE_S = 1.5

RawHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class OddVllm(FakeVllm):
    """A `FakeVllm` whose ``/health`` and ``/metrics`` may answer anything."""

    health: RawHandler | None = None
    metrics_raw: bytes | None = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.health is not None:
            answer = await self.health(request)
            assert isinstance(answer, web.Response)
            return answer
        return await super()._health(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_raw is not None:
            return web.Response(body=self.metrics_raw, content_type="text/plain")
        return await super()._metrics(request)


def answering(raw: bytes, status: int = 200, content_type: str = "application/json") -> Handler:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=status, body=raw, content_type=content_type)

    return handler


class Hang:
    """A handler that answers nothing (or, with ``first``, its headers and ``first``) until the
    router hangs up; ``gone`` is set when it saw the connection close."""

    def __init__(self, first: bytes | None = None, content_type: str = "text/event-stream"):
        self.first = first
        self.content_type = content_type
        self.entered = asyncio.Event()
        self.gone = asyncio.Event()

    async def __call__(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        if self.first is not None:
            response = web.StreamResponse(headers={"Content-Type": self.content_type})
            await response.prepare(request)
            await response.write(self.first)
        self.entered.set()
        # The fake's server has no handler cancellation: watch the connection instead.
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.01)
        self.gone.set()
        return response or web.Response()


def error_of(raw: bytes) -> dict[str, Any]:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# ---------------------------------------------------------------------- /metrics and /health


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-7", "1e308", "1e400"])
def test_absurd_metrics_values_never_raise_nor_give_an_absurd_load(value: str) -> None:
    text = (
        f"vllm:num_requests_running {value}\n"
        f"vllm:num_requests_waiting {value}\n"
        "vllm:num_requests_waiting 2\n"
        f"vllm:kv_cache_usage_perc {value}\n"
        f"vllm:inter_token_latency_seconds_sum {value}\n"
        f"vllm:inter_token_latency_seconds_count {value}\n"
    )
    load, timing = parse_vllm_metrics(text)
    assert load is not None
    if timing is not None:  # a gap total the rule may divide: finite, counts bounded
        assert math.isfinite(timing.itl_sum_s) and timing.itl_sum_s >= 0
        assert 0 <= timing.itl_count < 2**31 and 0 <= timing.running < 2**31
    for count in (load.running, load.waiting):
        assert 0 <= count < 2**31
    assert 0 <= load.kv_blocks_used <= load.kv_blocks_total <= KV_USAGE_SCALE
    assert math.isfinite(load.kv_usage) and 0.0 <= load.kv_usage <= 1.0


def test_a_server_exporting_nan_load_does_not_break_health_checks() -> None:
    async def scenario() -> None:
        nan = vllm_metrics(running=math.nan, waiting=math.inf, kv_usage=math.nan)
        async with vllm_cluster([prefill()], [VllmBehaviour(metrics=nan), decode()]) as c:
            workers = await c.workers()
            assert all(w["state"] == "SERVING" for w in workers.values()), workers
            code, raw, _ = await c.post(BODY)
            assert code == 200, raw

    run(scenario)


def test_a_health_answer_that_is_not_utf8_does_not_break_health_checks() -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"\xff\xfe\xfa ok", content_type="text/plain")

    async def scenario() -> None:
        odd = OddVllm(prefill(), health=garbage, metrics_raw=b"\xff\xfe\n")
        async with vllm_cluster([odd, prefill()], [decode()]) as c:
            workers = await c.workers()
            assert all(w["state"] == "SERVING" for w in workers.values()), workers
            assert workers[odd.address]["load"] is None
            code, raw, _ = await c.post(BODY)
            assert code == 200, raw

    run(scenario)


def test_a_metrics_answer_larger_than_the_router_reads_gives_no_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_endpoint, "MAX_METRICS_BYTES", 2**12)

    async def scenario() -> None:
        padded = vllm_metrics(running=3, waiting=2, kv_usage=0.25) + "# " + "x" * 2**13 + "\n"
        odd = OddVllm(prefill(), metrics_raw=padded.encode())
        async with vllm_cluster([odd], [decode()]) as c:
            workers = await c.workers()
            assert workers[odd.address]["state"] == "SERVING"
            assert workers[odd.address]["load"] is None

    run(scenario)


def test_a_health_that_redirects_is_not_serving() -> None:
    # A login page or another server behind the redirect must not vouch for the instance:
    # here the target (its /metrics) answers 200.
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/metrics")

    async def scenario() -> None:
        odd = OddVllm(prefill(), health=redirect)
        async with vllm_cluster([odd], [decode()]) as c:
            workers = await c.workers()
            assert workers[odd.address]["state"] == "NOT_SERVING (HTTP 302)"
            code, raw, _ = await c.post(BODY)
            assert code == 503, raw
            assert "no prefill daemon is healthy" in error_of(raw)["message"]
            assert odd.seen == []

    run(scenario)


# ---------------------------------------------------------------------- the prefill's answer

DEEP = b"[" * 100_000 + b"]" * 100_000
PREFILL_GARBAGE = [
    pytest.param(b"<html>not json</html>", id="not-json"),
    pytest.param(b"\xff\xfe\x00", id="not-utf8"),
    pytest.param(b"[1, 2]", id="a-list"),
    pytest.param(b'{"kv_transfer_params": "remote"}', id="params-a-string"),
    pytest.param(b'{"kv_transfer_params": [1, 2]}', id="params-a-list"),
    pytest.param(DEEP, id="deeply-nested"),
    pytest.param(b'{"kv_transfer_params": ' + DEEP + b"}", id="params-deeply-nested"),
]


@pytest.mark.parametrize("raw", PREFILL_GARBAGE)
def test_a_prefill_answering_200_garbage_is_retried_and_counts_on_its_breaker(raw: bytes) -> None:
    async def scenario() -> None:
        garbage = VllmBehaviour(completions=answering(raw))
        async with vllm_cluster(
            [garbage, prefill()], [decode()], policy="round_robin", breaker_failures=1
        ) as c:
            code, body, _ = await c.post(BODY)
            assert code == 200, body
            assert [len(p.seen) for p in c.prefills] == [1, 1]
            assert c.decodes[0].seen[0].body["kv_transfer_params"] == PARAMS
            assert (await c.workers())[c.prefills[0].address]["breaker"] == "open"
            await c.wait_idle()

    run(scenario)


@pytest.mark.parametrize("raw", PREFILL_GARBAGE)
def test_a_prefill_answering_only_garbage_is_a_typed_502(raw: bytes) -> None:
    async def scenario() -> None:
        garbage = VllmBehaviour(completions=answering(raw))
        async with vllm_cluster([garbage], [decode()]) as c:
            code, body, _ = await c.post(BODY)
            assert code == 502, body
            error = error_of(body)
            assert error["type"] == "upstream_error"
            assert error["message"].startswith(f"prefill daemon {c.prefills[0].address}:")
            assert "its answer" in error["message"]
            assert c.decodes[0].seen == []
            await c.wait_idle()

    run(scenario)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_5xx_whose_body_is_deeply_nested_json_is_a_typed_502(role: str) -> None:
    async def scenario() -> None:
        broken = VllmBehaviour(completions=answering(DEEP, status=500))
        good = prefill() if role == "decode" else broken
        async with vllm_cluster([good], [broken if role == "decode" else decode()]) as c:
            code, body, _ = await c.post(BODY)
            assert code == 502, body
            message = error_of(body)["message"]
            assert message.startswith(f"{role} daemon 127.0.0.1:")
            assert "HTTP 500" in message
            assert len(message) < 1000
            await c.wait_idle()

    run(scenario)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_4xx_whose_body_is_deeply_nested_json_goes_to_the_client_as_it_came(role: str) -> None:
    """The router passes a refusal through without reading it: the fleet page's record of the
    request (its handler's last step) reads no body either, so no parser's recursion turns it
    into a 500."""
    nested = b'{"error": ' * 100_000 + b"1" + b"}" * 100_000

    async def scenario() -> None:
        refusing = VllmBehaviour(completions=answering(nested, status=400))
        good = prefill() if role == "decode" else refusing
        async with vllm_cluster([good], [refusing if role == "decode" else decode()]) as c:
            code, body, _ = await c.post(BODY)
            assert (code, body) == (400, nested)
            recent = c.router.handlers.recent
            assert recent is not None
            [summary] = recent.newest_first()
            address = (c.decodes if role == "decode" else c.prefills)[0].address
            assert (summary.status, summary.error) == (
                400,
                f"{role} daemon {address} refused the request (HTTP 400); its answer went to "
                "the client as vLLM wrote it",
            )
            await c.wait_idle()

    run(scenario)


def test_a_huge_error_message_is_cut_short() -> None:
    async def scenario() -> None:
        huge = json.dumps({"error": {"message": "x" * 1_000_000}}).encode()
        async with vllm_cluster([VllmBehaviour(completions=answering(huge, 500))], [decode()]) as c:
            code, body, _ = await c.post(BODY)
            assert code == 502, body
            assert len(error_of(body)["message"]) < 1000

    run(scenario)


def test_a_prefill_answer_larger_than_the_router_takes_is_refused_unread() -> None:
    async def scenario() -> None:
        big = b'{"kv_transfer_params": {"x": "' + b"y" * 2**20 + b'"}}'
        fat = VllmBehaviour(completions=answering(big))
        async with vllm_cluster([fat], [decode()], max_request_bytes=2**20) as c:
            code, body, _ = await c.post(BODY)
            assert code == 502, body
            message = error_of(body)["message"]
            assert "larger than" in message
            assert c.decodes[0].seen == []
            await c.wait_idle()

    run(scenario)


# ---------------------------------------------------------------------- what the client sends


@pytest.mark.parametrize("route", ["disaggregated", "decode-alone", "prefill-gave-no-params"])
def test_a_clients_kv_transfer_params_never_reach_vllm(route: str) -> None:
    # They tell a decode where to pull KV from: only the prefill's answer may.
    async def no_params(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.json_response({"choices": [{"text": "."}]})

    async def scenario() -> None:
        p = VllmBehaviour(completions=no_params) if route == "prefill-gave-no-params" else prefill()
        alone = 8 if route == "decode-alone" else 0
        async with vllm_cluster([p], [decode()], disagg_min_prompt_tokens=alone) as c:
            evil = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_block_ids": [1]}
            body = {**BODY, "prompt": [1, 2, 3], "kv_transfer_params": evil}
            code, raw, _ = await c.post(body)
            assert code == 400, raw
            error = error_of(raw)
            assert error["param"] == "kv_transfer_params"
            assert c.prefills[0].seen == c.decodes[0].seen == []
            code, raw, _ = await c.post({**body, "kv_transfer_params": None})
            assert code == 200, raw

    run(scenario)


@pytest.mark.parametrize(
    "prompt", [["Hello", "World"], [[1, 2], [3, 4]]], ids=["strings", "token-lists"]
)
def test_a_batch_of_prompts_is_refused(prompt: Any) -> None:
    # vLLM answers one kv_transfer_params for a batch (its first prompt's): every other
    # prompt's decode would pull the first prompt's KV.
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            code, raw, _ = await c.post({**BODY, "prompt": prompt})
            assert code == 400, raw
            error = error_of(raw)
            assert error["param"] == "prompt"
            assert c.prefills[0].seen == c.decodes[0].seen == []
            for single in (["Hello"], [[1, 2]], [1, 2]):
                code, raw, _ = await c.post({**BODY, "prompt": single})
                assert code == 200, raw

    run(scenario)


@pytest.mark.parametrize(
    ("body", "status_code", "param"),
    [
        ({**BODY, "model": ["tiny"]}, 404, "model"),
        ({**BODY, "model": {"id": "tiny"}}, 404, "model"),
        ({**BODY, "n": "2"}, 400, "n"),
        ({**BODY, "best_of": [2]}, 400, "best_of"),
        ("a string", 400, None),
    ],
)
def test_odd_fields_are_typed_errors_before_any_instance(
    body: Any, status_code: int, param: str | None
) -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            code, raw, headers = await c.post(body)
            assert code == status_code, raw
            assert error_of(raw)["param"] == param
            assert headers["x-request-id"]
            assert c.prefills[0].seen == c.decodes[0].seen == []

    run(scenario)


@pytest.mark.parametrize(
    ("raw", "status_code", "needle"),
    [
        (b"\xff\xfe{}", 400, "UTF-8"),
        (b"[" * 10_000 + b"]" * 10_000, 400, "deeper"),
        (b'{"prompt": "\\ud800"}', 400, "surrogate"),
        (b"{" + b" " * (2**20 + 10) + b"}", 413, "--max-request-bytes"),
    ],
    ids=["not-utf8", "deep", "lone-surrogate", "too-large"],
)
def test_malformed_bodies_are_typed_errors(raw: bytes, status_code: int, needle: str) -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()], max_request_bytes=2**20) as c:
            async with c.http.post("/v1/completions", data=raw) as response:
                assert response.status == status_code
                assert needle in error_of(await response.read())["message"]
            assert c.prefills[0].seen == c.decodes[0].seen == []
            await c.wait_idle()

    run(scenario)


def test_client_credentials_and_upstream_cookies_do_not_cross_the_router() -> None:
    async def nosy(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        leaked = [h for h in ("Authorization", "Cookie", "X-Api-Key") if h in request.headers]
        answer = {**DECODE_JSON, "leaked": leaked}
        return web.json_response(answer, headers={"Set-Cookie": "session=upstream"})

    async def scenario() -> None:
        async with vllm_cluster([prefill()], [VllmBehaviour(completions=nosy)]) as c:
            secret = {"Authorization": "Bearer client-secret", "Cookie": "a=b", "X-Api-Key": "k"}
            code, raw, headers = await c.post(BODY, headers=secret)
            assert code == 200, raw
            assert json.loads(raw)["leaked"] == []
            assert "Set-Cookie" not in headers
            assert int(headers["Content-Length"]) == len(raw)

    run(scenario)


def test_stream_as_a_string_is_vllms_to_judge_and_passes_through() -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            code, raw, _ = await c.post({**BODY, "stream": "yes"})
            assert code == 200, raw
            assert c.decodes[0].seen[0].body["stream"] == "yes"
            assert c.prefills[0].seen[0].body["stream"] is False

    run(scenario)


# ---------------------------------------------------------------------- the decode's answer


def test_a_decode_answer_larger_than_the_router_holds_is_a_typed_502(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_proxy, "MAX_ANSWER_BYTES", 2**16)

    async def scenario() -> None:
        big = json.dumps({**DECODE_JSON, "pad": "x" * 2**17}).encode()
        fat = VllmBehaviour(completions=answering(big))
        async with vllm_cluster([prefill()], [fat, decode()], policy="round_robin") as c:
            code, raw, _ = await c.post(BODY)
            assert code == 502, raw[:200]
            message = error_of(raw)["message"]
            assert message.startswith(f"decode daemon {c.decodes[0].address}:")
            assert f"larger than {2**16} bytes" in message
            assert c.decodes[1].seen == []  # another decode would answer as much
            await c.wait_idle()

    run(scenario)


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_from_an_instance_is_not_followed(role: str, code: int) -> None:
    # The request (the client's body, the KV's whereabouts) goes to the instances listed,
    # nowhere else.
    async def scenario() -> None:
        elsewhere = OddVllm(prefill() if role == "prefill" else decode())
        await elsewhere.start()

        async def redirect(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            location = f"http://{elsewhere.address}{request.path}"
            return web.Response(status=code, headers={"Location": location})

        odd = VllmBehaviour(completions=redirect)
        try:
            p, d = ([odd], [decode()]) if role == "prefill" else ([prefill()], [odd])
            async with vllm_cluster(p, d) as c:
                status, raw, _ = await c.post(BODY)
                assert status == 502, raw
                message = error_of(raw)["message"]
                assert message.startswith(f"{role} daemon 127.0.0.1:")
                assert f"HTTP {code}" in message
                assert elsewhere.seen == []
                await c.wait_idle()
        finally:
            await elsewhere.stop()

    run(scenario)


# ---------------------------------------------------------------------- the request's deadline


@pytest.mark.parametrize(
    ("role", "hang", "silent"),
    [
        ("prefill", lambda: Hang(), True),
        ("decode", lambda: Hang(), True),
        ("decode", lambda: Hang(first=b"", content_type="text/event-stream"), False),
        ("decode", lambda: Hang(first=b"", content_type="application/json"), False),
        ("decode", lambda: Hang(first=b'{"choices": [', content_type="application/json"), False),
    ],
    ids=["prefill", "decode", "decode-stream-headers", "decode-json-headers", "decode-json-half"],
)
def test_an_instance_that_hangs_ends_at_the_deadline_with_a_typed_503(
    role: str, hang: Callable[[], Hang], silent: bool
) -> None:
    async def scenario() -> None:
        stuck = hang()
        odd = VllmBehaviour(completions=stuck)
        p, d = ([odd], [decode()]) if role == "prefill" else ([prefill()], [odd])
        async with vllm_cluster(p, d, request_timeout_s=DEADLINE_S, health_interval_s=600) as c:
            code, raw, _ = await c.post({**BODY, "stream": True})
            assert code == 503, raw
            error = error_of(raw)
            assert error["type"] == "upstream_error"
            assert error["message"].startswith(f"{role} daemon 127.0.0.1:")
            assert "request deadline" in error["message"]
            await asyncio.wait_for(stuck.gone.wait(), WAIT_S)  # its connection was closed
            await c.wait_idle()
            # Nothing counted against an instance for the request's length.
            workers = await c.workers()
            assert all(w["breaker"] == "closed" for w in workers.values())
            # One that sent nothing at all is out of the pool until a health check finds it
            # serving (as a daemon would be); one whose answer had begun is not.
            hung = (c.prefills if role == "prefill" else c.decodes)[0].address
            state = "UNREACHABLE (DEADLINE_EXCEEDED)" if silent else "SERVING"
            assert (workers[hung]["state"], workers[hung]["healthy"]) == (state, not silent)

    run(scenario)


def test_a_stream_that_stalls_after_its_first_event_ends_with_a_deadline_event() -> None:
    async def scenario() -> None:
        stuck = Hang(first=SSE_CHUNKS[0])
        async with vllm_cluster(
            [prefill()], [VllmBehaviour(completions=stuck)], request_timeout_s=DEADLINE_S
        ) as c:
            code, raw, _ = await c.post({**BODY, "stream": True})
            assert code == 200
            events = sse_events(raw.decode())
            assert events[0] == SSE_CHUNKS[0].decode().removeprefix("data: ").strip()
            assert events[-1] == "[DONE]"
            message = json.loads(events[-2])["error"]["message"]
            assert message.startswith(f"decode daemon {c.decodes[0].address}:")
            assert "request deadline" in message
            await asyncio.wait_for(stuck.gone.wait(), WAIT_S)
            await c.wait_idle()

    run(scenario)


# ---------------------------------------------------------------------- clients that leave


async def raw_post(c: VllmCluster, body: dict[str, Any]) -> tuple[Any, asyncio.StreamWriter]:
    """POST ``body`` over a bare socket, so the test can hang up mid-way."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", c.router.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_mid_prefill_frees_the_prefill_and_its_slot(stream: bool) -> None:
    async def scenario() -> None:
        stuck = Hang()
        odd = VllmBehaviour(completions=stuck)
        async with vllm_cluster([odd], [decode()], max_concurrent_requests=1) as c:
            _, writer = await raw_post(c, {**BODY, "stream": stream})
            await asyncio.wait_for(stuck.entered.wait(), WAIT_S)
            writer.close()
            await asyncio.wait_for(stuck.gone.wait(), WAIT_S)
            await c.wait_idle()
            assert c.decodes[0].seen == []
            odd.completions = prefill_ok
            code, raw, _ = await c.post(BODY)  # the only slot is free again
            assert code == 200, raw

    run(scenario)


def test_a_client_that_leaves_mid_stream_closes_the_decodes_connection() -> None:
    async def scenario() -> None:
        stuck = Hang(first=SSE_CHUNKS[0])
        async with vllm_cluster(
            [prefill()], [VllmBehaviour(completions=stuck)], max_concurrent_requests=1
        ) as c:
            reader, writer = await raw_post(c, {**BODY, "stream": True})
            head = await asyncio.wait_for(reader.readuntil(b"data: "), WAIT_S)
            assert head.startswith(b"HTTP/1.1 200")
            writer.close()
            await asyncio.wait_for(stuck.gone.wait(), WAIT_S)
            await c.wait_idle()
            assert (await c.workers())[c.decodes[0].address]["breaker"] == "closed"

    run(scenario)


# ---------------------------------------------------------------------- the fleet changing


def test_removing_an_instance_lets_its_requests_finish_and_the_router_serve_on() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        arrived = 0

        async def gated(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            nonlocal arrived
            arrived += 1
            await gate.wait()
            return await decode_ok(request, body)

        async with vllm_cluster([prefill()], [VllmBehaviour(completions=gated)]) as c:
            address = c.decodes[0].address
            instance = c.router.handlers.fleet.get(address)
            assert instance is not None
            posts = [asyncio.create_task(c.post({**BODY, "stream": i % 2 == 0})) for i in range(8)]

            async def all_arrived() -> bool:
                return arrived == 8

            await wait_until_async(all_arrived, "every request on the decode", WAIT_S)
            async with c.http.delete(f"/workers/{address}", headers=HEADERS) as response:
                assert response.status == 200
            gate.set()
            answers = await asyncio.gather(*posts)
            assert [code for code, _, _ in answers] == [200] * 8
            assert answers[0][1] == b"".join((*SSE_CHUNKS, SSE_DONE))
            assert json.loads(answers[1][1]) == DECODE_JSON
            assert instance.in_flight == 0
            code, raw, _ = await c.post(BODY)
            assert code == 503, raw  # no decode left
            # The shared HTTP session still serves: the instance comes back.
            body = {"address": address, "role": "decode"}
            async with c.http.post("/workers", json=body, headers=HEADERS) as response:
                assert response.status == 201
            code, raw, _ = await c.post(BODY)
            assert code == 200, raw
            await c.wait_idle()

    run(scenario)


def test_stopping_the_router_while_streams_run_closes_every_upstream_call() -> None:
    async def scenario() -> None:
        stalls = [Hang(first=SSE_CHUNKS[0]) for _ in range(3)]
        behaviours = [VllmBehaviour(completions=s) for s in stalls]
        async with vllm_cluster(
            [prefill()], behaviours, policy="round_robin", shutdown_timeout_s=0.2
        ) as c:
            readers = []
            for _ in stalls:
                reader, _ = await raw_post(c, {**BODY, "stream": True})
                await asyncio.wait_for(reader.readuntil(b"data: "), WAIT_S)
                readers.append(reader)
            await c.router.stop()
            for stall in stalls:
                await asyncio.wait_for(stall.gone.wait(), WAIT_S)
            for reader in readers:
                await asyncio.wait_for(reader.read(), WAIT_S)  # the router hung up
            assert c.router.handlers.admission.running == 0

    run(scenario)


# ---------------------------------------------------------------------- a stream's end, its usage


def ending_with(last: bytes) -> Handler:
    """A decode stream: one whole event, then ``last``, then a clean close (no ``[DONE]``)."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE_CHUNKS[0])
        await response.write(last)
        await response.write_eof()
        return response

    return handler


@pytest.mark.parametrize(
    "last",
    [b'data: {"choices": [{"te', b'data: {"choices": [{"text": "x"}]}\n', b"data: [DO"],
    ids=["mid-line", "mid-event", "mid-done"],
)
def test_a_stream_closed_mid_event_still_ends_with_a_readable_error_event(last: bytes) -> None:
    # Glued to the partial event, the error event is unreadable: a client that skips what it
    # cannot parse would then meet [DONE] and take the text so far for the whole answer.
    async def scenario() -> None:
        short = VllmBehaviour(completions=ending_with(last))
        async with vllm_cluster([prefill()], [short]) as c:
            code, raw, _ = await c.post({**BODY, "stream": True})
            assert code == 200
            events = sse_events(raw.decode())
            assert events[-1] == "[DONE]"
            message = json.loads(events[-2])["error"]["message"]
            assert message.startswith(f"decode daemon {c.decodes[0].address}:")
            assert "without vLLM's last event" in message
            await c.wait_idle()

    run(scenario)


def usage_of(cached_tokens: object) -> dict[str, Any]:
    return {"prompt_tokens_details": {"cached_tokens": cached_tokens}}


ABSURD_COUNTS = [pytest.param(10**400, id="past-a-float"), pytest.param(2**64, id="2**64")]


@pytest.mark.parametrize("reported", ABSURD_COUNTS)
def test_an_absurd_prefill_cached_count_is_not_counted_and_fails_nothing(reported: int) -> None:
    async def scenario() -> None:
        async def odd(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            params = {**PARAMS, vllm_proxy.REMOTE_CACHED_KEY: reported}
            return web.json_response({"choices": [{"text": " w"}], "kv_transfer_params": params})

        async with vllm_cluster(
            [VllmBehaviour(completions=odd)], [decode()], prefill_policy="cache_aware"
        ) as c:
            code, raw, _ = await c.post({**BODY, "prompt": list(range(1, 41))})
            assert code == 200, raw
            assert json.loads(raw) == DECODE_JSON
            metrics = await c.metrics_text()
            assert "kvtransfer_router_cache_predictions_total{" not in metrics
            assert 'kvtransfer_router_requests_total{status="200"} 1.0' in metrics
            await c.wait_idle()

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reported", ABSURD_COUNTS)
def test_an_absurd_decode_cached_count_is_not_counted_and_fails_nothing(
    reported: int, stream: bool
) -> None:
    async def scenario() -> None:
        odd = VllmBehaviour(completions=decode_answering_usage(usage_of(reported)))
        async with vllm_cluster(
            [prefill()], [odd], decode_policy="cache_aware", disagg_min_prompt_tokens=64
        ) as c:
            code, raw, _ = await c.post({**BODY, "prompt": list(range(1, 41)), "stream": stream})
            assert code == 200, raw
            assert c.prefills[0].seen == []  # the decode alone
            if stream:
                assert sse_events(raw.decode())[-1] == "[DONE]"
            else:
                assert json.loads(raw)["choices"] == DECODE_JSON["choices"]
            metrics = await c.metrics_text()
            assert "kvtransfer_router_cache_predictions_total{" not in metrics
            assert 'kvtransfer_router_requests_total{status="200"} 1.0' in metrics
            await c.wait_idle()

    run(scenario)
