"""The router in front of vLLM OpenAI servers (``engine="vllm"``), against stand-ins that record
what they are sent (`router_helpers.fake_vllm`): vLLM's kv_transfer_params flow (a one-token
prefill, its params verbatim to the decode, one ``X-Request-Id`` on both), answers passed
through as vLLM wrote them (JSON, events, refusals), retries on another instance before the
first byte, a stream cut after it, health and load from vLLM's own endpoints, conditional
disaggregation. Real vLLM servers behind the router: vllm_stage/check_pd.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from router_helpers.cluster import WAIT_S, run, sse_events
from router_helpers.fake_vllm import (
    DECODE_JSON,
    PARAMS,
    SSE_CHUNKS,
    SSE_DONE,
    VllmBehaviour,
    decode_cut,
    decode_paced,
    decode_reporting,
    decode_truncated,
    prefill_or_whole,
    prefill_reporting,
    prefill_without_params,
    status,
    vllm_itl_histogram,
    vllm_metrics,
)
from router_helpers.vllm_cluster import VllmCluster, decode, prefill, vllm_cluster
from waiting import wait_until_async

from kvtransfer.router import RouterConfig
from kvtransfer.router.fleet.vllm_endpoint import KV_USAGE_SCALE, parse_vllm_metrics
from kvtransfer.router.vllm_flow.answers import (
    ends_done,
    reported_cached_tokens,
    streamed_cached_tokens,
)
from kvtransfer.router.web.recent import RequestSummary

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}


async def recorded(c: VllmCluster) -> list[RequestSummary]:
    """The requests the fleet page lists, once there is one (the handler records a request
    as it returns, which may come after the client read the last byte)."""
    recent = c.router.handlers.recent
    assert recent is not None

    async def listed() -> list[RequestSummary]:
        return recent.newest_first()

    return await wait_until_async(listed, "the request on the fleet page", WAIT_S)


def test_the_prefill_gets_one_token_and_its_params_go_verbatim_to_the_decode() -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            body = {**BODY, "min_tokens": 4, "logprobs": 2, "echo": True}
            code, raw, headers = await c.post(body)
            assert code == 200
            assert json.loads(raw) == DECODE_JSON
            request_id = headers["x-request-id"]
            [sent_p] = c.prefills[0].seen
            [sent_d] = c.decodes[0].seen
            assert sent_p.path == sent_d.path == "/v1/completions"
            assert sent_p.request_id == sent_d.request_id == request_id
            assert sent_p.body == {
                "model": "tiny",
                "prompt": "Hello",
                "temperature": 0,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            }
            assert sent_d.body == {**body, "kv_transfer_params": PARAMS}

    run(scenario)


def test_a_stream_passes_through_byte_for_byte_and_chat_keeps_its_path() -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
            body |= {"max_completion_tokens": 5, "stream_options": {"include_usage": True}}
            code, raw, headers = await c.post(body, "/v1/chat/completions")
            assert code == 200
            assert headers["Content-Type"].startswith("text/event-stream")
            assert raw == b"".join((*SSE_CHUNKS, SSE_DONE))
            [sent_p] = c.prefills[0].seen
            [sent_d] = c.decodes[0].seen
            assert sent_p.path == sent_d.path == "/v1/chat/completions"
            assert "max_completion_tokens" not in sent_p.body
            assert "stream_options" not in sent_p.body
            assert (sent_p.body["max_tokens"], sent_p.body["stream"]) == (1, False)
            assert sent_d.body == {**body, "kv_transfer_params": PARAMS}

    run(scenario)


def test_vllm_refusing_the_input_is_passed_to_the_client_and_no_decode_runs() -> None:
    refusal = "This model's maximum context length is 32 tokens"

    async def scenario() -> None:
        bad = VllmBehaviour(completions=status(400, refusal))
        async with vllm_cluster([bad], [decode()]) as c:
            code, raw, _ = await c.post(BODY)
            assert code == 400
            assert json.loads(raw)["error"]["message"] == refusal
            assert c.decodes[0].seen == []
            assert len(c.prefills[0].seen) == 1  # a refusal is not retried
            # The fleet page records who refused, not vLLM's body (its text, any size).
            [summary] = await recorded(c)
            assert (summary.status, summary.error) == (
                400,
                f"prefill daemon {c.prefills[0].address} refused the request (HTTP 400); its "
                "answer went to the client as vLLM wrote it",
            )

    run(scenario)


def test_an_unreachable_prefill_is_ejected_and_another_one_prefills() -> None:
    async def scenario() -> None:
        # Round robin, two instances: the first pick is the first one (it dies after its
        # health check, and none follows before the request).
        async with vllm_cluster(
            [prefill(), prefill()], [decode()], policy="round_robin", health_interval_s=600
        ) as c:
            dies, good = c.prefills
            await dies.stop()
            code, raw, _ = await c.post(BODY)
            assert code == 200, raw
            assert len(good.seen) == 1
            assert c.decodes[0].seen[0].body["kv_transfer_params"] == PARAMS
            gone = (await c.workers())[dies.address]
            assert (gone["healthy"], gone["state"]) == (False, "UNREACHABLE (UNAVAILABLE)")

    run(scenario)


def test_a_prefill_answering_5xx_is_retried_on_another_and_counts_on_its_breaker() -> None:
    async def scenario() -> None:
        broken = VllmBehaviour(completions=status(500, "engine dead"))
        async with vllm_cluster(
            [broken, prefill()], [decode()], policy="round_robin", breaker_failures=1
        ) as c:
            code, raw, _ = await c.post(BODY)
            assert code == 200, raw
            assert [len(p.seen) for p in c.prefills] == [1, 1]
            assert c.decodes[0].seen[0].body["kv_transfer_params"] == PARAMS
            assert (await c.workers())[c.prefills[0].address]["breaker"] == "open"

    run(scenario)


def test_prefills_that_all_answer_5xx_end_in_a_typed_502_naming_the_last_one() -> None:
    """Every prefill answered, with its own error: the last failure is the answer (502, the
    server's fault), not the 503 of a role with nothing to pick (nothing sent, `Retry-After`)."""

    async def scenario() -> None:
        broken = VllmBehaviour(completions=status(500, "engine dead"))
        async with vllm_cluster(
            [broken, broken], [decode()], max_retries=1, policy="round_robin"
        ) as c:
            code, raw, headers = await c.post(BODY)
            assert (code, json.loads(raw)) == (
                502,
                {
                    "error": {
                        "message": f"prefill daemon {c.prefills[1].address}: HTTP 500: engine dead",
                        "type": "upstream_error",
                        "param": None,
                        "code": None,
                    }
                },
            )
            assert "Retry-After" not in headers
            assert [len(p.seen) for p in c.prefills] == [1, 1]
            assert c.decodes[0].seen == []

    run(scenario)


def test_a_decode_that_fails_before_its_first_byte_is_retried_with_the_same_params() -> None:
    async def scenario() -> None:
        broken = VllmBehaviour(completions=status(503, "overloaded"))
        async with vllm_cluster([prefill()], [broken, decode()], policy="round_robin") as c:
            code, raw, _ = await c.post({**BODY, "stream": True})
            assert code == 200
            assert raw == b"".join((*SSE_CHUNKS, SSE_DONE))
            [first] = c.decodes[0].seen
            [second] = c.decodes[1].seen
            assert first.body == second.body
            assert second.body["kv_transfer_params"] == PARAMS
            assert first.request_id == second.request_id
            assert len(c.prefills[0].seen) == 1  # the KV is prefilled once

    run(scenario)


@pytest.mark.parametrize("other_decode", [True, False], ids=["another-decode", "none-left"])
def test_a_decode_retry_carrying_a_prefills_kv_never_goes_to_an_aggregated_instance(
    other_decode: bool,
) -> None:
    """An aggregated server computes its prompts itself: KV params from a prefill would have
    it pull KV it never asked for. Round robin over [broken, (good,) aggregated] picks the
    broken decode first; the retry's next turn would be the aggregated server were it a
    candidate."""

    async def scenario() -> None:
        broken = VllmBehaviour(completions=status(503, "overloaded"))
        decodes = [broken, decode()] if other_decode else [broken]
        async with vllm_cluster(
            [prefill()], decodes, aggregated=[decode()], policy="round_robin"
        ) as c:
            code, raw, _ = await c.post(BODY)
            [agg] = c.aggregated
            assert agg.seen == []
            [first] = c.decodes[0].seen
            assert first.body["kv_transfer_params"] == PARAMS
            if other_decode:
                assert (code, json.loads(raw)) == (200, DECODE_JSON)
                [second] = c.decodes[1].seen
                assert second.body == first.body
            else:
                # No decode left to pull the KV: the broken one's failure is the answer.
                error = json.loads(raw)["error"]
                assert (code, error["message"]) == (
                    502,
                    f"decode daemon {c.decodes[0].address}: HTTP 503: overloaded",
                )
            assert len(c.prefills[0].seen) == 1
            text = await c.metrics_text()
            assert 'kvtransfer_router_routes_total{mode="disaggregated"} 1.0' in text.splitlines()

    run(scenario)


def test_a_stream_cut_after_its_first_byte_ends_with_an_error_event() -> None:
    async def scenario() -> None:
        cut_now = asyncio.Event()
        cut = VllmBehaviour(completions=decode_cut(cut_now))
        async with vllm_cluster([prefill()], [cut, decode()], policy="round_robin") as c:
            body = {**BODY, "stream": True}
            async with c.http.post("/v1/completions", json=body) as response:
                assert response.status == 200
                first = await response.content.readuntil(b"\n\n")
                assert first == SSE_CHUNKS[0]  # passed on before the decode dies
                cut_now.set()
                raw = first + await response.content.read()
            events = sse_events(raw.decode())
            assert events[0] == SSE_CHUNKS[0].decode().removeprefix("data: ").strip()
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["message"].startswith(f"decode daemon {c.decodes[0].address}:")
            assert "cut" in error["message"]
            assert c.decodes[1].seen == []  # bytes were out: no retry
            # Its 200 went out first; the fleet page records it as failed.
            [summary] = await recorded(c)
            assert (summary.status, summary.stream_failed, summary.error) == (
                200,
                True,
                error["message"],
            )

    run(scenario)


def test_a_stream_closed_without_done_ends_with_an_error_event_not_as_complete() -> None:
    async def scenario() -> None:
        short = VllmBehaviour(completions=decode_truncated)
        async with vllm_cluster([prefill()], [short], policy="round_robin") as c:
            code, raw, _ = await c.post({**BODY, "stream": True})
            assert code == 200
            events = sse_events(raw.decode())
            assert events[:2] == [e.decode().removeprefix("data: ").strip() for e in SSE_CHUNKS]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["message"] == (
                f"decode daemon {c.decodes[0].address}: its stream ended without vLLM's last "
                "event (data: [DONE])"
            )
            errors = 'kvtransfer_router_upstream_errors_total{reason="truncated",role="decode"} 1.0'
            assert errors in (await c.metrics_text()).splitlines()

    run(scenario)


def _prediction_lines(text: str, role: str) -> dict[str, float]:
    prefixes = ("kvtransfer_router_cached_tokens_total", "kvtransfer_router_cache_predictions")
    found = {}
    for line in text.splitlines():
        if line.startswith(prefixes) and f'role="{role}"' in line and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_the_prefills_cache_prediction_is_held_against_what_vllm_reported() -> None:
    async def scenario() -> None:
        # The prefill says its prefix cache served 32 tokens each time (vLLM's
        # remote_prefill_cached_tokens in the params it returns).
        reporting = VllmBehaviour(completions=prefill_reporting(32))
        async with vllm_cluster([reporting], [decode()], prefill_policy="cache_aware") as c:
            prompt = {**BODY, "prompt": list(range(1, 41))}  # 2 whole blocks of 16, and 8
            for _ in range(2):
                code, _, _ = await c.post(prompt)
                assert code == 200
            # The first pick knew nothing (0 predicted, 32 reported: under); the second had
            # learned both blocks from the first (32 predicted: exact).
            assert _prediction_lines(await c.metrics_text(), "prefill") == {
                'kvtransfer_router_cached_tokens_total{role="prefill",source="predicted"}': 32.0,
                'kvtransfer_router_cached_tokens_total{role="prefill",source="reported"}': 64.0,
                'kvtransfer_router_cache_predictions_total{outcome="under",role="prefill"}': 1.0,
                'kvtransfer_router_cache_predictions_total{outcome="exact",role="prefill"}': 1.0,
            }

    run(scenario)


@pytest.mark.parametrize("reported", [None, "32", True, -1])
def test_a_missing_or_odd_cached_count_is_not_counted(reported: object) -> None:
    async def scenario() -> None:
        async def odd(request: Any, body: dict[str, Any]) -> Any:
            params = {**PARAMS, "remote_prefill_cached_tokens": reported}
            return web.json_response({"choices": [{"text": " w"}], "kv_transfer_params": params})

        async with vllm_cluster(
            [VllmBehaviour(completions=odd)], [decode()], prefill_policy="cache_aware"
        ) as c:
            code, _, _ = await c.post({**BODY, "prompt": list(range(1, 41))})
            assert code == 200
            assert _prediction_lines(await c.metrics_text(), "prefill") == {}

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_alone_holds_its_prediction_against_its_usage(stream: bool) -> None:
    async def scenario() -> None:
        reporting = VllmBehaviour(completions=decode_reporting(16))
        async with vllm_cluster(
            [prefill()], [reporting], decode_policy="cache_aware", disagg_min_prompt_tokens=64
        ) as c:
            code, raw, _ = await c.post({**BODY, "prompt": list(range(1, 41)), "stream": stream})
            assert code == 200
            if stream:  # passed through whole: the usage chunk, then [DONE]
                events = sse_events(raw.decode())
                assert json.loads(events[-2])["usage"]["prompt_tokens_details"] == {
                    "cached_tokens": 16
                }
                assert events[-1] == "[DONE]"
            assert c.prefills[0].seen == []  # 40 uncached tokens < 64: the decode alone
            assert _prediction_lines(await c.metrics_text(), "decode") == {
                'kvtransfer_router_cached_tokens_total{role="decode",source="predicted"}': 0.0,
                'kvtransfer_router_cached_tokens_total{role="decode",source="reported"}': 16.0,
                'kvtransfer_router_cache_predictions_total{outcome="under",role="decode"}': 1.0,
            }

    run(scenario)


def test_a_prefill_without_params_leaves_the_decode_to_compute_alone() -> None:
    async def scenario() -> None:
        first_stops = VllmBehaviour(completions=prefill_without_params)
        async with vllm_cluster([first_stops], [decode()]) as c:
            code, _, _ = await c.post(BODY)
            assert code == 200
            assert c.decodes[0].seen[0].body == BODY

    run(scenario)


@pytest.mark.parametrize(
    ("body", "status_code", "needle"),
    [
        ({**BODY, "n": 2}, 400, "n must be 1"),
        ({**BODY, "best_of": 3}, 400, "best_of must be 1"),
        ([1, 2], 400, "must be a JSON object"),
        ({**BODY, "model": "other"}, 404, "does not exist"),
    ],
)
def test_bad_requests_are_refused_before_any_instance(
    body: Any, status_code: int, needle: str
) -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()]) as c:
            code, raw, _ = await c.post(body)
            assert code == status_code
            assert needle in json.loads(raw)["error"]["message"]
            assert c.prefills[0].seen == c.decodes[0].seen == []

    run(scenario)


def test_health_and_load_come_from_vllm_endpoints() -> None:
    async def scenario() -> None:
        loaded = VllmBehaviour(metrics=vllm_metrics(running=3, waiting=2, kv_usage=0.25))
        draining = VllmBehaviour(health_status=503)
        async with vllm_cluster([prefill(), draining], [loaded]) as c:
            workers = await c.workers()
            load = workers[c.decodes[0].address]["load"]
            assert load == {
                "running": 3,
                "waiting": 2,
                "kv_blocks_used": KV_USAGE_SCALE // 4,
                "kv_blocks_total": KV_USAGE_SCALE,
            }
            sick = workers[c.prefills[1].address]
            assert (sick["state"], sick["pickable"]) == ("NOT_SERVING (HTTP 503)", False)
            for _ in range(4):
                code, _, _ = await c.post(BODY)
                assert code == 200
            assert c.prefills[1].seen == []
            assert len(c.prefills[0].seen) == 4

            c.prefills[1].behaviour.health_status = 200

            async def readmitted() -> bool:
                return (await c.workers())[c.prefills[1].address]["pickable"] is True

            await wait_until_async(readmitted, "the prefill back in the pool", WAIT_S)

    run(scenario)


def test_a_short_known_prompt_skips_the_prefill() -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()], disagg_min_prompt_tokens=8) as c:
            short = {**BODY, "prompt": [1, 2, 3]}
            code, _, _ = await c.post(short)
            assert code == 200
            assert c.prefills[0].seen == []
            assert c.decodes[0].seen[0].body == short
            long = {**BODY, "prompt": list(range(1, 20))}
            code, _, _ = await c.post(long)
            assert code == 200
            assert len(c.prefills[0].seen) == 1
            assert c.decodes[0].seen[1].body == {**long, "kv_transfer_params": PARAMS}

    run(scenario)


def test_vllm_load_text_parses_to_sums_and_mean_usage() -> None:
    load, timing = parse_vllm_metrics(vllm_metrics(running=5, waiting=1, kv_usage=0.5))
    assert load is not None and timing is None  # gauges, no inter-token histogram
    assert (load.running, load.waiting) == (5, 1)
    assert load.kv_usage == 0.5
    assert parse_vllm_metrics("# nothing of vLLM's\nprocess_cpu_seconds_total 3\n") == (
        None,
        None,
    )
    assert parse_vllm_metrics("not prometheus {{{") == (None, None)


def test_tls_is_refused_for_vllm_servers(tmp_path: Any) -> None:
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="plain HTTP"):
        RouterConfig(prefill=("h:1",), decode=("h:2",), engine="vllm", tls_ca=str(pem))
    with pytest.raises(ValueError, match="engine must be one of kvtransfer, vllm"):
        RouterConfig(prefill=("h:1",), decode=("h:2",), engine="sglang")


def test_the_servers_api_key_goes_on_every_completion_call_never_the_clients() -> None:
    async def scenario() -> None:
        async with vllm_cluster([prefill()], [decode()], vllm_api_key="sk-servers") as c:
            headers = {"Authorization": "Bearer client-secret"}
            async with c.http.post("/v1/completions", json=BODY, headers=headers) as response:
                assert response.status == 200
            [sent_p] = c.prefills[0].seen
            [sent_d] = c.decodes[0].seen
            assert sent_p.authorization == sent_d.authorization == "Bearer sk-servers"
        async with vllm_cluster([prefill()], [decode()]) as c:
            async with c.http.post("/v1/completions", json=BODY, headers=headers) as response:
                assert response.status == 200
            assert [s.authorization for s in (*c.prefills[0].seen, *c.decodes[0].seen)] == [
                None,
                None,
            ]

    run(scenario)
    with pytest.raises(ValueError, match="a vLLM API key goes with --engine vllm"):
        RouterConfig(prefill=("h:1",), decode=("h:2",), vllm_api_key="sk")


@pytest.mark.parametrize(
    ("tail", "done"),
    [
        (b"data: [DONE]\n\n", True),
        (b'data: {"x": 1}\r\n\r\ndata: [DONE]\r\n\r\n', True),
        (b"data:[DONE]\n\n", True),
        (b'data: {"text": "[DONE]"}\n\n', False),
        (b"data: [DONE", False),
        (b"xdata: [DONE]\n\n", False),
        (b"", False),
    ],
)
def test_the_done_event_is_recognised_by_its_whole_last_line(tail: bytes, done: bool) -> None:
    assert ends_done(tail) is done


def test_a_stream_without_a_usage_chunk_is_not_counted() -> None:
    async def scenario() -> None:
        async with vllm_cluster(
            [prefill()], [decode()], decode_policy="cache_aware", disagg_min_prompt_tokens=64
        ) as c:
            code, _, _ = await c.post({**BODY, "prompt": list(range(1, 41)), "stream": True})
            assert code == 200
            assert _prediction_lines(await c.metrics_text(), "decode") == {}

    run(scenario)


@pytest.mark.parametrize(
    ("tail", "count"),
    [
        (b'data: {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 7}}}'
         b"\r\n\r\ndata: [DONE]\r\n\r\n", 7),
        (b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n', None),
        (b'"cached_tokens": 7}}}\n\ndata: [DONE]\n\n', None),  # its start cut off
        (b"data: [DONE]\n\n", None),
    ],
)  # fmt: skip
def test_a_streams_usage_chunk_is_read_from_its_last_bytes(tail: bytes, count: object) -> None:
    assert streamed_cached_tokens(tail) == count


@pytest.mark.parametrize(
    ("raw", "count"),
    [
        (json.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}).encode(), 5),
        (b'{"usage": {"prompt_tokens_details": null}}', None),
        (b'{"usage": [1]}', None),
        (b"[1]", None),
        (b"not json", None),
        (b"[" * 100_000, None),  # nested past the parser's recursion limit
        # Past the bound the answer is not parsed, whatever it says.
        (b'{"usage": {"prompt_tokens_details": {"cached_tokens": 5}}}' + b" " * (1 << 20), None),
    ],
)
def test_a_decodes_reported_hit_is_read_within_a_bound(raw: bytes, count: object) -> None:
    assert reported_cached_tokens(raw) == count


def test_slo_routing_reads_the_gaps_and_the_batch_from_vllms_own_metrics() -> None:
    """A decode whose /metrics has vLLM's inter-token histogram: between two health checks
    the change of its sum over the change of its count is the gap the rule predicts from,
    filed under vLLM's running count, which is the batch when larger than the router's."""

    async def scenario() -> None:
        gauges = vllm_metrics(running=2, waiting=0, kv_usage=0.1)
        decode = VllmBehaviour(metrics=gauges + vllm_itl_histogram(1.0, 10))
        async with vllm_cluster(
            [prefill()], [decode], slo_ttft_ms=60_000, slo_itl_ms=60_000, health_interval_s=0.1
        ) as c:

            async def service() -> dict[str, Any]:
                return (await c.workers())[c.decodes[0].address]["service"]

            async def read_once() -> bool:
                return (await service())["server_running"] == 2

            await wait_until_async(read_once, "vLLM's running count read", WAIT_S)
            assert (await service())["itl_source"] == "router"
            # 20 more gaps taking 0.6 s: 30 ms each, at 2 running.
            decode.metrics = gauges + vllm_itl_histogram(1.6, 30)

            async def gaps_read() -> bool:
                return (await service())["itl_source"] == "vllm"

            await wait_until_async(gaps_read, "vLLM's inter-token gaps read", WAIT_S)
            measured = await service()
            assert measured["inter_token_s_by_batch"] == {"2": pytest.approx(0.03)}
            assert measured["decoding"] == 0  # the router's own count: nothing routed yet
            # A prompt the prefill's rate is known for: the prediction is vLLM's gap, at
            # vLLM's batch plus this request.
            body = {**BODY, "prompt": list(range(1, 20))}
            assert (await c.post(body))[0] == 200  # measures the prefill's rate
            code, _, headers = await c.post(body)
            assert code == 200
            assert headers["x-kvtransfer-route"].startswith("disaggregated; reason=pd_meets_slo")
            assert "itl_pd_s=0.03" in headers["x-kvtransfer-route"], headers

    run(scenario)


def test_with_the_decode_past_its_gap_target_an_idle_prefill_is_tried_then_kept() -> None:
    """The decode's own gap (router-timed at batch 1, then vLLM's at its 5 running) puts P/D
    past the ITL target: the prefill, where no request alone was measured yet and whose steps
    (taken as the decode's at batch 1) would meet it, gets the whole request without
    kv_transfer_params and no decode is called; the gap that request got there meets the
    target, so the next one goes there too."""

    async def scenario() -> None:
        whole = VllmBehaviour(completions=prefill_or_whole(decode_paced(0.1)))
        gauges = vllm_metrics(running=5, waiting=0, kv_usage=0.1)
        paced = VllmBehaviour(
            completions=decode_paced(0.1), metrics=gauges + vllm_itl_histogram(0.0, 0)
        )
        slo = {"slo_ttft_ms": 60_000, "slo_itl_ms": 1_000, "health_interval_s": 0.1}
        async with vllm_cluster([whole], [paced], **slo) as c:
            body = {**BODY, "prompt": list(range(1, 20)), "stream": True}
            assert (await c.post(body))[0] == 200  # the prefill's rate, the decode's pace
            # 10 gaps of 0.9 s at 5 running: P/D's gap at 6 is 1.1 s (the slope from 0.1 s
            # at 1), past the 1 s target.
            paced.metrics = gauges + vllm_itl_histogram(9.0, 10)

            async def vllm_gaps_read() -> bool:
                workers = await c.workers()
                return workers[c.decodes[0].address]["service"]["itl_source"] == "vllm"

            await wait_until_async(vllm_gaps_read, "vLLM's gaps read", WAIT_S)
            gaps = (await c.workers())[c.decodes[0].address]["service"]["inter_token_s_by_batch"]
            decoded_before = len(c.decodes[0].seen)

            async def alone_gap() -> float | None:
                return (await c.workers())[c.prefills[0].address]["service"]["alone_gap_s"]

            for reason in ("neither_meets_try_prefill", "prefill_alone_meets_slo"):
                code, raw, headers = await c.post(body)
                assert code == 200, raw
                route = headers["x-kvtransfer-route"]
                assert route.startswith(f"prefill_only; reason={reason}"), route
                predicted = dict(part.split("=") for part in route.split("; ")[2:])
                if reason == "neither_meets_try_prefill":
                    # The decode's step at batch 1 (the prefill never decoded), its prompt's
                    # share of the last 10 s aside (a millisecond).
                    assert float(predicted["itl_prefill_s"]) == pytest.approx(gaps["1"], rel=0.01)
                assert raw == b"".join((*SSE_CHUNKS, SSE_DONE))
                alone = c.prefills[0].seen[-1].body
                assert "kv_transfer_params" not in alone
                assert (alone["max_tokens"], alone["stream"]) == (BODY["max_tokens"], True)
                # The gap it got there (its events 0.1 s apart, give or take the reading) is
                # what the next one is predicted: recorded as its stream closes, which may
                # come after the client read it.
                assert await wait_until_async(alone_gap, "the gap recorded", WAIT_S) >= 0.05
            assert len(c.decodes[0].seen) == decoded_before
            metrics = await c.metrics_text()
            for line in (
                'kvtransfer_router_routes_total{mode="prefill_only"} 2.0',
                "kvtransfer_router_route_decisions_total"
                '{mode="prefill_only",reason="neither_meets_try_prefill"} 1.0',
                "kvtransfer_router_route_decisions_total"
                '{mode="prefill_only",reason="prefill_alone_meets_slo"} 1.0',
            ):
                assert line in metrics.splitlines(), line
            await c.wait_idle()

    run(scenario)


def test_with_slo_targets_held_back_requests_reach_a_busy_prefill_fewest_tokens_first() -> None:
    """Both prefill turns held (as if two prompts computed there): a long prompt, then a short
    one, wait in the router; the first turn that frees goes to the short one."""

    async def scenario() -> None:
        slo = {"slo_ttft_ms": 60_000, "slo_itl_ms": 60_000, "request_timeout_s": 3.0}
        async with vllm_cluster([prefill()], [decode()], **slo) as c:
            proxy = c.router.handlers.backend.vllm
            assert proxy is not None and proxy.decider.order is not None
            order = proxy.decider.order
            short, long = list(range(1, 10)), list(range(1, 200))
            assert (await c.post({**BODY, "prompt": short}))[0] == 200  # the rate measured
            held = [asyncio.Event(), asyncio.Event()]

            async def hold(event: asyncio.Event) -> None:
                async with order.turn(1, 0.0, float("inf"), 2, lambda n: 0.0):
                    await event.wait()

            holders = [asyncio.create_task(hold(event)) for event in held]
            answers = []
            for prompt, waiting in ((long, 1), (short, 2)):
                answers.append(asyncio.create_task(c.post({**BODY, "prompt": prompt})))

                async def held_back(n: int = waiting) -> bool:
                    return order.waiting == n

                await wait_until_async(held_back, f"{waiting} held back", WAIT_S)
            held[0].set()
            assert (await answers[1])[0] == 200
            held[1].set()
            assert (await answers[0])[0] == 200
            await asyncio.gather(*holders)
            prompts = [seen.body["prompt"] for seen in c.prefills[0].seen]
            assert prompts == [short, short, long]
            # Held past its deadline: a 503 naming the wait, and no prefill was called.
            again = [asyncio.Event(), asyncio.Event()]
            holders = [asyncio.create_task(hold(event)) for event in again]
            code, raw, _ = await c.post({**BODY, "prompt": short})
            assert code == 503, raw
            assert b"deadline passed while it waited for a turn at the busy prefills" in raw
            assert len(c.prefills[0].seen) == 3
            for event in again:
                event.set()
            await asyncio.gather(*holders)
            metrics = await c.metrics_text()
            for how in ("in_time", "timed_out"):
                count = 2 if how == "in_time" else 1
                line = f'kvtransfer_router_prefill_wait_seconds_count{{order="{how}"}} {count}.0'
                assert line in metrics.splitlines(), line
            await c.wait_idle()

    run(scenario)


def test_slo_routing_measures_the_servers_and_says_its_decision_in_a_header() -> None:
    """With SLO targets the vLLM flow decides as the daemon flow does, from the prefill calls'
    durations and the gaps between the decode's events it timed, and names the decision in
    ``x-kvtransfer-route`` (vLLM's answer is passed through as it came)."""

    async def scenario() -> None:
        paced = VllmBehaviour(completions=decode_paced(0.1))
        async with vllm_cluster([prefill()], [paced], slo_ttft_ms=60_000, slo_itl_ms=60_000) as c:
            body = {**BODY, "prompt": list(range(1, 20)), "stream": True}
            code, _, headers = await c.post(body)
            assert code == 200
            assert headers["x-kvtransfer-route"] == (
                "disaggregated; reason=no_profile; uncached_tokens=19"
            )
            workers = await c.workers()
            measured_prefill = workers[c.prefills[0].address]["service"]
            assert measured_prefill["prompt_tokens_per_s"] > 0
            assert measured_prefill["queued_prompt_tokens"] == 0
            measured_decode = workers[c.decodes[0].address]["service"]
            assert measured_decode["decoding"] == 0
            (gap,) = measured_decode["inter_token_s_by_batch"].values()
            # The one gap between the two events, as the router read them: the decode's pace
            # give or take the router's scheduling (a busy CI run read the first event 3 ms late
            # and measured 0.047 s for a 0.05 s pace), nowhere near a buffer read at once.
            assert gap >= 0.05, measured_decode
            code, _, headers = await c.post({**body, "stream": False})
            assert code == 200
            assert headers["x-kvtransfer-route"].startswith("disaggregated; reason=pd_meets_slo")
            # A text prompt's tokens are unknown without a tokenizer: P/D, saying why.
            code, _, headers = await c.post(BODY)
            assert headers["x-kvtransfer-route"] == "disaggregated; reason=prompt_tokens_unknown"
            metrics = await c.metrics_text()
            for reason in ("no_profile", "pd_meets_slo", "prompt_tokens_unknown"):
                line = (
                    "kvtransfer_router_route_decisions_total"
                    f'{{mode="disaggregated",reason="{reason}"}} 1.0'
                )
                assert line in metrics.splitlines(), line

    run(scenario)
