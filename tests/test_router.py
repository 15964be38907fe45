"""The router alone, against fake Generation daemons (real grpc.aio servers with scripted
answers, `router_helpers.fakes`) and a real HTTP client: what each daemon is asked, what the
client gets back (JSON and SSE, byte framing included), round-robin, the 400 table, upstream
errors mapped to HTTP statuses, deadlines, client disconnects, /health, /v1/models, /metrics
and the command line. The end-to-end run with real daemons is tests/test_router_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2
from router_helpers.cluster import (
    SCENARIO_TIMEOUT_S,
    WAIT_S,
    cluster,
    free_port,
    post_stream,
    raw_completion,
    run,
    sse_events,
    wait_for_health,
    wait_for_metric,
)
from router_helpers.fakes import (
    DECODE_METRICS,
    DECODE_PIECES,
    FIRST_PIECE,
    Behaviour,
    FakeDaemon,
    decode_ok,
    fail,
    finish_error,
    gated,
    hang,
    params_for,
    prefill_ok,
    prefill_streaming,
)
from waiting import wait_until_async

from kvtransfer.router import RouterConfig, RouterServer
from kvtransfer.router.__main__ import main as router_main

pytestmark = pytest.mark.integration

# What the client gets: the prefill's first token, then the decode stream.
DECODE_TEXT = FIRST_PIECE[1] + "".join(text for _, text in DECODE_PIECES)
DECODE_IDS = FIRST_PIECE[0] + [t for ids, _ in DECODE_PIECES for t in ids]


# ---------------------------------------------------------------------- the happy path


def test_prefill_then_decode_json_body(caplog):
    caplog.set_level(logging.INFO, logger="kvtransfer.router")

    async def scenario():
        async with cluster() as c:
            body = {
                "model": "builtin",
                "prompt": "Hello",
                "max_tokens": 7,
                "temperature": 0.5,
                "top_p": 0.9,
                "seed": 1234,
                "stop": "\n\n",
                "user": "ignored",
            }
            async with c.http.post("/v1/completions", json=body) as response:
                assert response.status == 200
                answer = await response.json()
                header_id = response.headers["x-request-id"]
            (pre,) = c.prefill.requests
            (dec,) = c.decode.requests
            request_id = answer["id"]
            assert re.fullmatch(r"cmpl-[0-9a-f]{32}", request_id)
            assert pre.request_id == dec.request_id == request_id == header_id
            # The prefill: one token, the same sampling, asked to keep its KV for a decoder.
            assert pre.WhichOneof("prompt") == "text" and pre.text == "Hello"
            assert pre.sampling.max_tokens == 1
            assert json.loads(pre.kv_transfer_params_json) == {
                "do_remote_decode": True,
                "kv_stream": True,
            }
            assert pre.sampling.temperature == pytest.approx(0.5)
            assert pre.sampling.top_p == pytest.approx(0.9)
            assert pre.sampling.seed == 1234
            # A stop in the first token ends the request there, as it would colocated.
            assert list(pre.sampling.stop) == ["\n\n"]
            # The decode: the original request and exactly the params the prefill returned,
            # continuing after the prefill's first token.
            assert dec.text == "Hello"
            assert list(dec.generated_token_ids) == FIRST_PIECE[0]
            assert dec.kv_transfer_params_json == params_for(c.prefill.address, request_id)
            assert dec.sampling.max_tokens == 7
            assert dec.sampling.temperature == pytest.approx(0.5)
            assert dec.sampling.top_p == pytest.approx(0.9)
            assert dec.sampling.seed == 1234
            assert list(dec.sampling.stop) == ["\n\n"]
            info = answer.pop("kvtransfer")
            assert isinstance(answer.pop("created"), int)
            assert answer == {
                "id": request_id,
                "object": "text_completion",
                "model": "builtin",
                "choices": [
                    {"index": 0, "text": DECODE_TEXT, "finish_reason": "length", "logprobs": None}
                ],
                "usage": {
                    "prompt_tokens": 5,
                    "completion_tokens": len(DECODE_IDS),
                    "total_tokens": 5 + len(DECODE_IDS),
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
            ttft = info.pop("ttft_s")
            assert isinstance(ttft, float) and ttft >= 0
            # The router's own spans, in the order its steps ran (these fakes send none).
            timeline = info.pop("timeline")
            assert isinstance(info.pop("timeline_origin_unix_ns"), int)
            names = [row["name"] for row in timeline]
            assert names[:6] == [
                "router.parse",
                "router.tokenize",
                "router.admit",
                "router.pick",
                "router.pick",
                "router.prefill_call",
            ]
            assert [row["attributes"]["role"] for row in timeline[3:5]] == ["decode", "prefill"]
            assert {"router.decode_first_message", "router.decode_call"} <= set(names[6:])
            assert [row["start_ms"] for row in timeline] == sorted(r["start_ms"] for r in timeline)
            assert all(row["duration_ms"] >= 0 for row in timeline)
            # Each daemon's phases, joined (the fakes report only the decode's transfer), and
            # the first-to-second token gap the router saw.
            phases = info.pop("phases")
            second = phases.pop("second_token_s")
            assert isinstance(second, float) and second >= 0
            assert phases == {
                "prefill_queue_s": 0.0,
                "prefill_compute_s": 0.0,
                "decode_queue_s": 0.0,
                "kv_transfer_s": DECODE_METRICS.kv_transfer_s,
                "kv_overlapped_s": 0.0,
                "decode_first_step_s": 0.0,
            }
            assert info == {
                "request_id": request_id,
                "prefill": c.prefill.address,
                "decode": c.decode.address,
                "token_ids": DECODE_IDS,
                "kv_transfer_s": DECODE_METRICS.kv_transfer_s,
                "kv_blocks_received": DECODE_METRICS.kv_blocks_received,
                "kv_bytes_received": DECODE_METRICS.kv_bytes_received,
                "num_recomputed_tokens": 0,
                "predicted_cached_tokens": None,  # round robin keeps no prefix index
                # No threshold, no SLO targets: every request is disaggregated.
                "route_decision": {
                    "mode": "disaggregated",
                    "reason": "always_disaggregate",
                    "uncached_tokens": None,
                    "predicted": {},
                },
            }
            assert c.prefill.cancelled == c.decode.cancelled == []
            return request_id

    request_id = asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S))
    about = [r for r in caplog.records if r.name == "kvtransfer.router" and r.levelno >= 20]
    messages = [r.getMessage() for r in about]
    assert any(m.startswith("received") for m in messages), messages
    assert any(m.startswith("done (length)") for m in messages), messages
    assert {getattr(r, "request_id", None) for r in about} == {request_id}


def test_a_prefill_that_streams_its_kv_has_its_decode_called_while_it_computes():
    async def scenario():
        async with cluster() as c:
            c.prefill.behaviour = prefill_streaming(c.prefill.address)
            status, body = await c.post({"prompt": "Hello", "max_tokens": 7})
            assert status == 200, body
            (dec,) = c.decode.requests
            # Called with the announced params, before the first token existed ...
            assert dec.await_generated_tokens and list(dec.generated_token_ids) == []
            assert dec.kv_transfer_params_json == params_for(c.prefill.address, body["id"])
            # ... which then came through Continue.
            (cont,) = c.decode.continues
            assert (cont.request_id, list(cont.generated_token_ids)) == (body["id"], [62])
            assert body["choices"][0]["text"] == DECODE_TEXT
            assert body["kvtransfer"]["token_ids"] == DECODE_IDS
            assert c.prefill.releases == [] and c.decode.cancelled == []
            # A first token that ends the request: the decode called early is cancelled, and
            # the prefill's KV released.
            c.prefill.behaviour = prefill_streaming(c.prefill.address, finish_reason="stop")
            status, body = await c.post({"prompt": "Hello", "max_tokens": 7})
            assert status == 200, body
            assert body["choices"][0]["finish_reason"] == "stop"
            await c.prefill.released.wait()
            assert [r.request_id for r in c.prefill.releases] == [body["id"]]
            assert len(c.decode.continues) == 1
            # The early call was cancelled at once: if it reached the daemon at all, it ended
            # there cancelled.
            late = [r.request_id for r in c.decode.requests[1:]]

            async def ended_cancelled() -> bool:
                return set(late) <= set(c.decode.cancelled)

            await wait_until_async(ended_cancelled, f"decode calls {late} ended cancelled", 2)

    run(scenario)


def test_prompt_forms_token_ids_and_batches_of_one():
    async def scenario():
        async with cluster() as c:
            for prompt, oneof, value in [
                ([1, 2, 3], "token_ids", [1, 2, 3]),
                ([[4, 5]], "token_ids", [4, 5]),
                (["one"], "text", "one"),
                ([0], "token_ids", [0]),
            ]:
                status, body = await c.post({"prompt": prompt})
                assert status == 200, body
                for sent in (c.prefill.requests[-1], c.decode.requests[-1]):
                    assert sent.WhichOneof("prompt") == oneof
                    got = list(sent.token_ids.ids) if oneof == "token_ids" else sent.text
                    assert got == value
                # Defaults: 16 tokens, greedy, no seed; null means the default too.
            status, _ = await c.post({"prompt": "x", "max_tokens": None, "stop": None})
            assert status == 200
            sampling = c.decode.requests[-1].sampling
            assert sampling.max_tokens == 16 and sampling.temperature == 0
            assert not sampling.HasField("seed") and list(sampling.stop) == []

    run(scenario)


def test_stream_sse_framing_and_chunks():
    async def scenario():
        async with cluster() as c:
            response, raw = await post_stream(c, {"prompt": "Hello", "max_tokens": 4})
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            # The prefill's first token, then one chunk per decode message with text (the
            # text-less one is skipped); the last carries the finish reason and kvtransfer.
            assert [ch["choices"][0]["text"] for ch in chunks] == [">", "He", "llo", "!"]
            finish_reasons = [ch["choices"][0]["finish_reason"] for ch in chunks]
            assert finish_reasons == [None, None, None, "length"]
            request_id = c.decode.requests[0].request_id
            assert response.headers["x-request-id"] == request_id
            for chunk in chunks:
                assert chunk["id"] == request_id and chunk["object"] == "text_completion"
                assert chunk["model"] == "builtin" and chunk["created"] == chunks[0]["created"]
                assert "usage" not in chunk
            assert ["kvtransfer" in ch for ch in chunks] == [False, False, False, True]
            info = chunks[-1]["kvtransfer"]
            assert info["token_ids"] == DECODE_IDS and info["request_id"] == request_id
            assert info["decode"] == c.decode.address
            assert info["kv_blocks_received"] == DECODE_METRICS.kv_blocks_received

    run(scenario)


def test_round_robin_over_two_prefill_and_two_decode_daemons():
    async def scenario():
        async with cluster(prefills=[None, None], decodes=[None, None]) as c:
            routes = []
            for _ in range(4):
                status, body = await c.post({"prompt": "x", "max_tokens": 2})
                assert status == 200, body
                routes.append((body["kvtransfer"]["prefill"], body["kvtransfer"]["decode"]))
            p0, p1 = (f.address for f in c.prefills)
            d0, d1 = (f.address for f in c.decodes)
            assert routes == [(p0, d0), (p1, d1), (p0, d0), (p1, d1)]
            for fake in (*c.prefills, *c.decodes):
                assert len(fake.requests) == 2
            # Each decode got the params of the prefill that ran the same request.
            for fake in c.decodes:
                for sent in fake.requests:
                    owner = next(p for p in c.prefills if sent.request_id in _ids(p))
                    assert sent.kv_transfer_params_json == params_for(
                        owner.address, sent.request_id
                    )

    run(scenario)


def _ids(fake: FakeDaemon) -> set[str]:
    return {r.request_id for r in fake.requests}


# ---------------------------------------------------------------------- bad requests

BAD_BODIES: list[tuple[Any, str | None, str]] = [
    ({}, "prompt", "prompt: Field required"),
    ({"prompt": ""}, "prompt", "prompt: must not be empty"),
    ({"prompt": []}, "prompt", "prompt: must not be empty"),
    ({"prompt": 5}, "prompt", "prompt: must be a string"),
    ({"prompt": ["a", ""]}, "prompt", "prompt: [1]: must not be empty"),
    ({"prompt": [[1], "x", 3.5]}, "prompt", "prompt: [2]: must be a string, a list of"),
    ({"prompt": [1, -2]}, "prompt", "prompt: token ids must be integers in [0, 2**32)"),
    ({"prompt": [1, True]}, "prompt", "prompt: token ids must be integers"),
    ({"prompt": [1.5]}, "prompt", "prompt: must be a string"),
    ({"prompt": [2**32]}, "prompt", "prompt: token ids must be integers"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens: Input should be a valid"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "max_tokens: Input should be a valid"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens: Input should be a valid"),
    ({"prompt": "x", "max_tokens": 2**32}, "max_tokens", "max_tokens: Input should be less"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature: Input should be greater"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "temperature: Input should be"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p: Input should be greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p: Input should be less than or equal to 1"),
    ({"prompt": "x", "seed": "1"}, "seed", "seed: Input should be a valid integer"),
    ({"prompt": "x", "seed": 1.5}, "seed", "seed: Input should be a valid integer"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "stop: at most 4"),
    ({"prompt": "x", "stop": 3}, "stop", "stop: Input should be a valid list"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop", "stop: Input should be a valid string"),
    ({"prompt": "x", "stop": [""]}, "stop", "stop: stop strings must not be empty"),
    ({"prompt": "x", "stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ({"prompt": "x", "model": 7}, "model", "model: Input should be a valid string"),
    ({"prompt": "x", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ({"prompt": "x", "n": True}, "n", "n: Input should be a valid integer"),
    ({"prompt": ["x", "y"], "n": 65}, "n", "n: 2 prompts x n=65 is 130 choices, at most 128"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of: not supported"),
    ({"prompt": [5], "echo": True}, "echo", "echo: only supported for text prompts"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo", "echo: not supported with logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "logprobs: Input should be a valid integer"),
    ({"prompt": "x", "presence_penalty": 1}, "presence_penalty", "presence_penalty: not supported"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "logit_bias: not supported"),
    ({"prompt": "x", "suffix": "s"}, "suffix", "suffix: not supported"),
    (
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options: only allowed when stream is true",
    ),
    (["x"], None, "the request body must be a JSON object"),
]


def test_bad_bodies_get_400_naming_the_field_and_reach_no_daemon():
    async def scenario():
        async with cluster() as c:
            for body, param, message in BAD_BODIES:
                status, answer = await c.post(body)
                assert status == 400, (body, answer)
                assert answer == {
                    "error": {
                        "message": answer["error"]["message"],
                        "type": "invalid_request_error",
                        "param": param,
                        "code": None,
                    }
                }, body
                assert answer["error"]["message"].startswith(message), (body, answer)
            for raw in (b"{not json", b"", b"\xef\xbb\xbf{}"):
                status, answer = await c.post(raw=raw)
                assert status == 400, raw
                assert answer["error"]["message"] == "the request body is not valid JSON"
            status, answer = await c.post({"prompt": "x", "model": "gpt-9"})
            assert status == 404
            assert answer["error"]["param"] == "model"
            assert answer["error"]["code"] == "model_not_found"
            assert answer["error"]["message"].startswith("model 'gpt-9' does not exist")
            assert c.prefill.requests == c.decode.requests == []
            # Defaults of the unsupported fields, and unknown fields, are fine.
            fine = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "logprobs": None}
            status, answer = await c.post({**fine, "presence_penalty": 0, "user": "u"})
            assert status == 200, answer

    run(scenario)


# ---------------------------------------------------------------------- upstream errors


def test_grpc_errors_and_error_finishes_map_to_http_statuses():
    code = grpc.StatusCode

    async def scenario():
        async with cluster(health_interval_s=0.02) as c:
            p, d = c.prefill, c.decode
            good = {"prefill": p.behaviour, "decode": d.behaviour}
            # (role at fault, its behaviour, HTTP status, the message after the daemon's name)
            cases: list[tuple[str, Behaviour, int, str]] = [
                ("prefill", fail(code.INVALID_ARGUMENT, "prompt: bad"), 400, "INVALID_ARGUMENT"),
                ("prefill", fail(code.RESOURCE_EXHAUSTED, "pool"), 400, "RESOURCE_EXHAUSTED"),
                ("prefill", fail(code.UNAVAILABLE, "draining"), 503, "UNAVAILABLE: draining"),
                ("prefill", fail(code.INTERNAL, "boom"), 502, "INTERNAL: boom"),
                ("prefill", finish_error("engine died"), 502, "engine died"),
                ("prefill", prefill_ok(p.address, with_params=False), 502, "no kv_transfer"),
                ("decode", fail(code.INVALID_ARGUMENT, "kv_transfer_params: bad"), 400, "INV"),
                ("decode", fail(code.UNAVAILABLE, "stopping"), 503, "UNAVAILABLE: stopping"),
                ("decode", finish_error("KV load failed", [([1], "a")]), 502, "KV load failed"),
            ]
            for role, behaviour, status, text in cases:
                p.behaviour, d.behaviour = good["prefill"], good["decode"]
                # An UNAVAILABLE answer ejected its daemon: the next health check puts it back.
                await wait_for_health(c, "ok")
                fake = p if role == "prefill" else d
                fake.behaviour = behaviour
                decode_calls = len(d.requests)
                got, answer = await c.post({"prompt": "x"})
                assert got == status, (text, answer)
                message = answer["error"]["message"]
                assert message.startswith(f"{role} daemon {fake.address}: {text}"), message
                kind = "invalid_request_error" if status < 500 else "upstream_error"
                assert answer["error"]["type"] == kind
                # A failed prefill never reaches a decode daemon.
                assert len(d.requests) == decode_calls + (role == "decode"), text
            p.behaviour = fail(code.INVALID_ARGUMENT, "prompt.token_ids[1] = 99999 is outside")
            _, answer = await c.post({"prompt": [1, 99999]})
            assert answer["error"]["message"] == (
                f"prefill daemon {p.address}: INVALID_ARGUMENT: "
                "prompt.token_ids[1] = 99999 is outside"
            )

    run(scenario)


def test_unreachable_daemons_are_named_in_503s_and_nothing_is_sent():
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        for role in ("decode", "prefill"):
            async with cluster(**{f"{role}s": [], f"extra_{role}": [dead]}) as c:
                status, answer = await c.post({"prompt": "x"})
                assert (status, answer) == (
                    503,
                    {
                        "error": {
                            "message": f"no {role} daemon is healthy "
                            f"({dead}: UNREACHABLE (UNAVAILABLE))",
                            "type": "upstream_error",
                            "param": None,
                            "code": "no_healthy_daemon",
                        }
                    },
                )
                # Checked before anything is sent: no prefill for a decode that is not there.
                assert [f.requests for f in (*c.prefills, *c.decodes)] == [[]]

    run(scenario)


def test_deadline_turns_a_hung_daemon_into_503_not_a_hang():
    async def scenario():
        async with cluster(prefills=[hang()], request_timeout_s=0.3, health_interval_s=0.02) as c:
            status, answer = await c.post({"prompt": "x"})
            assert status == 503
            message = answer["error"]["message"]
            assert message.startswith(f"prefill daemon {c.prefill.address}: DEADLINE_EXCEEDED")
            await c.prefill.cancelled_event.wait()  # the daemon saw the call end
            assert c.decode.requests == []
            # It answered nothing before the deadline: ejected until a health check passes.
            await wait_for_health(c, "ok")
            # The deadline covers the whole request: a decode that hangs after its first
            # message ends the stream with an SSE error event, then [DONE].
            c.prefill.behaviour = prefill_ok(c.prefill.address)
            c.decode.behaviour = hang([([9], "Hi")])
            response, raw = await post_stream(c, {"prompt": "x"})
            assert response.status == 200
            events = sse_events(raw)
            texts = [json.loads(e)["choices"][0]["text"] for e in events[:2]]
            assert texts == [FIRST_PIECE[1], "Hi"]
            error = json.loads(events[2])["error"]
            assert error["message"].startswith(
                f"decode daemon {c.decode.address}: DEADLINE_EXCEEDED"
            )
            assert error["type"] == "upstream_error"
            assert events[3:] == ["[DONE]"]
            # A decode that was streaming is alive: the deadline was the request's, no ejection.
            assert (await c.get("/health"))[1]["decode"] == {c.decode.address: "SERVING"}

    run(scenario)


def test_stream_errors_before_and_after_the_first_byte():
    async def scenario():
        async with cluster() as c:
            d = c.decode
            # After the first chunks: an SSE error event naming the daemon, then [DONE].
            error = {
                "error": {
                    "message": f"decode daemon {d.address}: KV load failed",
                    "type": "upstream_error",
                    "param": None,
                    "code": None,
                }
            }
            d.behaviour = finish_error("KV load failed", [([1], "ab")])
            response, raw = await post_stream(c, {"prompt": "x"})
            assert response.status == 200
            events = sse_events(raw)
            texts = [json.loads(e)["choices"][0]["text"] for e in events[:2]]
            assert texts == [FIRST_PIECE[1], "ab"]
            assert [json.loads(e) for e in events[2:-1]] == [error]
            assert events[-1] == "[DONE]"
            # Its 200 went out first; the fleet page records it as failed.
            recent = c.router.handlers.recent
            assert recent is not None

            async def recorded() -> list[Any]:
                return recent.newest_first()

            [summary] = await wait_until_async(recorded, "the request recorded", WAIT_S)
            assert (summary.status, summary.stream_failed, summary.error) == (
                200,
                True,
                error["error"]["message"],
            )
            # The first token (from the prefill) is out before the decode daemon answers:
            # a decode that fails at once is an error event after it.
            d.behaviour = finish_error("KV load failed")
            response, raw = await post_stream(c, {"prompt": "x"})
            events = sse_events(raw)
            assert json.loads(events[0])["choices"][0]["text"] == FIRST_PIECE[1]
            assert json.loads(events[1]) == error and events[2:] == ["[DONE]"]
            # Before any byte (the prefill failed): still a plain HTTP error with its status.
            for behaviour, status in [
                (finish_error("out of blocks"), 502),
                (fail(grpc.StatusCode.UNAVAILABLE, "draining"), 503),
            ]:
                c.prefill.behaviour = behaviour
                async with c.http.post(
                    "/v1/completions", json={"prompt": "x", "stream": True}
                ) as response:
                    assert response.status == status
                    assert response.content_type == "application/json"
                    answer = await response.json()
                prefix = f"prefill daemon {c.prefill.address}: "
                assert answer["error"]["message"].startswith(prefix)
                await wait_for_health(c, "ok")

    run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_client_disconnect_cancels_the_upstream_call(stream):
    async def scenario():
        async with cluster(decodes=[hang([([1], "a")])]) as c:
            reader, writer = await raw_completion(c, {"prompt": "x", "stream": stream})
            await c.decode.received.wait()
            if stream:  # the first chunk is out: the client is mid-stream
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.close()
            await writer.wait_closed()
            await c.decode.cancelled_event.wait()
            assert c.decode.cancelled == [c.decode.requests[0].request_id]
            metrics = await wait_for_metric(c, 'kvtransfer_router_requests_total{status="499"}')
            assert 'kvtransfer_router_requests_total{status="499"} 1.0' in metrics

    run(scenario)


# ---------------------------------------------------------------------- other endpoints


def test_health_models_and_metrics():
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        async with cluster(prefills=[None, None], extra_decode=[dead], health_interval_s=0.02) as c:
            p0, p1 = c.prefills
            status, body = await c.get("/health")
            # One serving decode is enough; the dead one is named.
            assert status == 200
            assert body["status"] == "ok"
            assert body["prefill"] == {p0.address: "SERVING", p1.address: "SERVING"}
            assert body["decode"][c.decode.address] == "SERVING"
            assert body["decode"][dead] == "UNREACHABLE (UNAVAILABLE)"
            await p0.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            await wait_for_health(c, "ok", "prefill", p0.address, "NOT_SERVING")
            await p1.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            body = await wait_for_health(c, "unavailable")
            assert (await c.get("/health"))[0] == 503
            assert body["prefill"] == {p0.address: "NOT_SERVING", p1.address: "NOT_SERVING"}
            for prefill in (p0, p1):
                await prefill.set_health(health_pb2.HealthCheckResponse.SERVING)
            await wait_for_health(c, "ok", "prefill", p1.address, "SERVING")

            status, body = await c.get("/v1/models")
            assert status == 200
            assert body == {
                "object": "list",
                "data": [{"id": "builtin", "object": "model", "owned_by": "kvtransfer"}],
            }

            assert (await c.post({"prompt": "x"}))[0] == 200
            assert (await c.post({"prompt": ""}))[0] == 400
            c.decode.behaviour = fail(grpc.StatusCode.UNAVAILABLE, "draining")
            assert (await c.post({"prompt": "x"}))[0] == 503
            status, text = await c.get("/metrics")
            assert status == 200
            for line in [
                'kvtransfer_router_requests_total{status="200"} 1.0',
                'kvtransfer_router_requests_total{status="400"} 1.0',
                'kvtransfer_router_requests_total{status="503"} 1.0',
                "kvtransfer_router_request_seconds_count 3.0",
                # The first token comes from the prefill: the decode failure came after it.
                "kvtransfer_router_time_to_first_token_seconds_count 2.0",
                'kvtransfer_router_upstream_errors_total{reason="UNAVAILABLE",role="decode"} 1.0',
                f'kvtransfer_router_daemon_healthy{{address="{p0.address}",role="prefill"}} 1.0',
                f'kvtransfer_router_daemon_healthy{{address="{dead}",role="decode"}} 0.0',
                "kvtransfer_router_daemon_ejections_total"
                f'{{address="{p0.address}",role="prefill",state="NOT_SERVING"}} 1.0',
                f'kvtransfer_router_daemon_readmissions_total{{address="{p0.address}",'
                'role="prefill"} 1.0',
            ]:
                assert line in text.splitlines(), line

    run(scenario)


def test_model_name_is_configurable():
    async def scenario():
        async with cluster(model_name="tiny-llama") as c:
            assert (await c.get("/v1/models"))[1]["data"][0]["id"] == "tiny-llama"
            status, body = await c.post({"prompt": "x", "model": "tiny-llama"})
            assert status == 200 and body["model"] == "tiny-llama"
            assert (await c.post({"prompt": "x", "model": "builtin"}))[0] == 404

    run(scenario)


def test_mtls_to_the_daemons(tmp_path):
    from control_helpers.certs import make_certs

    certs = make_certs(tmp_path)

    def server_credentials() -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(open(certs.server_key, "rb").read(), open(certs.server_cert, "rb").read())],
            root_certificates=open(certs.ca, "rb").read(),
            require_client_auth=True,
        )

    async def scenario():
        prefill = await FakeDaemon("prefill", credentials=server_credentials()).start()
        decode = await FakeDaemon("decode", credentials=server_credentials()).start()
        tls = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
        try:
            for extra, status in [(tls, 200), ({}, 503)]:
                config = RouterConfig((prefill.address,), (decode.address,), **extra)
                async with (
                    RouterServer(config) as router,
                    aiohttp.ClientSession(base_url=router.url) as http,
                    http.post("/v1/completions", json={"prompt": "x"}) as response,
                ):
                    assert response.status == status, await response.text()
        finally:
            await prefill.stop()
            await decode.stop()

    run(scenario)


def test_config_is_checked_up_front(tmp_path):
    good = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    not_pem = tmp_path / "x.pem"
    not_pem.write_text("hello")
    for overrides, message in [
        ({"prefill": ()}, "at least one prefill daemon"),
        ({"decode": ["nohost"]}, "'nohost' is not HOST:PORT"),
        ({"decode": ["h:99999"]}, "is not HOST:PORT"),
        ({"port": -1}, "port must be in"),
        ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
        ({"tls_cert": str(not_pem)}, "certificate and key go together"),
        ({"tls_ca": str(tmp_path / "missing.pem")}, "cannot read"),
        ({"tls_ca": str(not_pem)}, "is not a PEM file"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            RouterConfig(**{**good, **overrides})
    assert RouterConfig(prefill=["[::1]:5"], decode=["h:6"]).prefill == ("[::1]:5",)


# ---------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "at least one prefill daemon is required (HOST:PORT or dns:NAME:PORT), unless"),
        (["--prefill", "x", "--decode", "h:1"], "argument --prefill: 'x' is not HOST:PORT"),
        (["--prefill", "h:1", "--decode", "h:1", "--port", "70000"], "port must be in"),
        (["--prefill", "h:1", "--decode", "h:1", "--request-timeout-s", "0"], "must be > 0"),
        (["--prefill", "h:1", "--decode", "h:1", "--tls-ca", "/nope.pem"], "cannot read"),
        (["--prefill", "h:1", "--decode", "h:1", "--port", "eighty"], "invalid int value"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        router_main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "kvtransfer-router: error: " in err and message in err, err


def test_module_entry_point_bad_flags_exit_2_without_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "kvtransfer.router", "--prefill", "nope", "--decode", "h:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "error: argument --prefill: 'nope' is not HOST:PORT" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_prints_its_url_serves_and_drains_on_sigterm():
    async def scenario():
        gate = asyncio.Event()
        prefill = await FakeDaemon("prefill").start()
        decode = await FakeDaemon("decode").start()
        argv = ["--port", "0", "--prefill", prefill.address, "--decode", decode.address]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvtransfer.router",
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            line = (await process.stdout.readline()).decode()
            match = re.fullmatch(r"router listening on (http://127\.0\.0\.1:(\d+))\n", line)
            assert match, line
            url, port = match.group(1), int(match.group(2))
            async with aiohttp.ClientSession(base_url=url) as http:
                async with http.post("/v1/completions", json={"prompt": "x"}) as response:
                    assert response.status == 200
                    assert (await response.json())["choices"][0]["text"] == DECODE_TEXT
                # A request in flight when SIGTERM arrives still completes.
                decode.behaviour = gated(gate, decode_ok())
                in_flight = asyncio.create_task(http.post("/v1/completions", json={"prompt": "y"}))

                async def reached_decode() -> bool:
                    return len(decode.requests) >= 2

                await wait_until_async(reached_decode, "the second request reached the decode")
                process.send_signal(signal.SIGTERM)
                await _wait_until_refused(port)  # stopped accepting
                gate.set()
                async with await in_flight as response:
                    assert response.status == 200
                    assert (await response.json())["choices"][0]["text"] == DECODE_TEXT
            assert await process.wait() == 0
            stderr = (await process.stderr.read()).decode()
            assert "stopping" in stderr and "Traceback" not in stderr
            assert re.search(r"\[request_id=cmpl-[0-9a-f]{32}\] received", stderr), stderr
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await prefill.stop()
            await decode.stop()

    run(scenario)


async def _wait_until_refused(port: int) -> None:
    async def refused() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionError:  # refused, or reset: the listener closed under the connect
            return True
        writer.close()
        await writer.wait_closed()
        return False

    await wait_until_async(refused, f"the router on port {port} refusing connections")
