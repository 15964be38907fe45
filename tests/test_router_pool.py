"""The router's health-checked daemon pool, its KV releases and its input limits, against fake
daemons (`router_helpers.fakes`): a daemon whose call fails at the transport level is ejected at
once and re-admitted by a health check; NOT_SERVING daemons are skipped; no prefill runs while
no decode daemon is healthy; a decode that fails, or a client that goes away, after the prefill
returned its params makes the router call ReleaseKV with exactly those params, without making
the client wait; deep JSON, invalid Unicode and oversized bodies are 400s and 413s naming the
problem. Real daemons: tests/test_router_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2
from router_helpers.cluster import (
    Cluster,
    cluster,
    post_stream,
    raw_completion,
    run,
    sse_events,
    wait_for_health,
    wait_for_metric,
)
from router_helpers.fakes import (
    FakeDaemon,
    decode_ok,
    fail,
    finish_error,
    gated,
    hang,
    params_for,
    prefill_ok,
    release_answer,
    release_fails,
    release_gated,
)

from kvtransfer.clients.limits import DEFAULT_MAX_REQUEST_BYTES, GRPC_HEADROOM_BYTES
from kvtransfer.router import RouterConfig
from kvtransfer.router.__main__ import _parser, config_from_args
from kvtransfer.router.daemon_flow.releases import PREFILL_GRACE_S
from kvtransfer.router.openai.requests import MAX_JSON_DEPTH
from kvtransfer.v1 import generation_pb2

pytestmark = pytest.mark.integration

# No background check in the test's lifetime: only calls change a daemon's health.
NO_CHECKS = 600.0
FAST_CHECKS = 0.02
UNREACHABLE = "UNREACHABLE (UNAVAILABLE)"


def release_of(prefill: FakeDaemon, request_id: str) -> generation_pb2.ReleaseKVRequest:
    """The ReleaseKV a prefill fake must get: its own params for ``request_id``, verbatim."""
    return generation_pb2.ReleaseKVRequest(
        request_id=request_id, kv_transfer_params_json=params_for(prefill.address, request_id)
    )


def metric_line(name: str, **labels: str) -> str:
    inside = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inside}}}"


async def metric_value(c: Cluster, name: str, **labels: str) -> float | None:
    _, text = await c.get("/metrics")
    needle = metric_line(name, **labels) + " "
    for line in text.splitlines():
        if line.startswith(needle):
            return float(line.removeprefix(needle))
    return None


async def released(c: Cluster, trigger: str, outcome: str) -> None:
    """Waits until the router counted one more release with this trigger and outcome."""
    await wait_for_metric(
        c,
        metric_line("kvtransfer_router_kv_releases_total", trigger=trigger, outcome=outcome)
        + " 1.0",
    )


# ---------------------------------------------------------------------- ejection, re-admission


def test_a_failed_call_ejects_its_daemon_at_once_and_no_prefill_runs_without_decode(caplog):
    caplog.set_level(logging.INFO, logger="kvtransfer.router")

    async def scenario():
        down = fail(grpc.StatusCode.UNAVAILABLE, "Connection refused")
        async with cluster(decodes=[down], health_interval_s=NO_CHECKS) as c:
            p, d = c.prefill, c.decode
            status, answer = await c.post({"prompt": "x"})
            assert status == 503
            message = f"decode daemon {d.address}: UNAVAILABLE: Connection refused"
            assert answer["error"]["message"] == message
            (first,) = p.requests
            # Its KV is given back at once, with the params it returned, not left to the lease.
            await p.released.wait()
            assert p.releases == [release_of(p, first.request_id)]
            await released(c, "decode_failed", "released")

            # Ejected: the next request is refused before any prefill, naming the decode daemon.
            status, answer = await c.post({"prompt": "y"})
            assert (status, answer["error"]) == (
                503,
                {
                    "message": f"no decode daemon is healthy ({d.address}: {UNREACHABLE})",
                    "type": "upstream_error",
                    "param": None,
                    "code": "no_healthy_daemon",
                },
            )
            assert len(p.requests) == 1 and len(d.requests) == 1 and len(p.releases) == 1
            status, body = await c.get("/health")
            assert (status, body["decode"]) == (503, {d.address: UNREACHABLE})
            assert body["prefill"] == {p.address: "SERVING"}
            labels = {"role": "decode", "address": d.address}
            assert await metric_value(c, "kvtransfer_router_daemon_healthy", **labels) == 0.0
            ejections = "kvtransfer_router_daemon_ejections_total"
            assert await metric_value(c, ejections, **labels, state=UNREACHABLE) == 1
            healthy = "kvtransfer_router_daemon_healthy"
            assert await metric_value(c, healthy, role="prefill", address=p.address) == 1

    run(scenario)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith("decode daemon ") and f" ejected: {UNREACHABLE} (a call failed: " in m
        for m in warnings
    ), warnings


def test_round_robin_skips_dead_and_draining_daemons_and_readmits_them(caplog):
    caplog.set_level(logging.INFO, logger="kvtransfer.router")

    async def scenario():
        async with cluster(decodes=[None, None], health_interval_s=FAST_CHECKS) as c:
            d0, d1 = c.decodes

            async def spread(n: int) -> list[int]:
                before = [len(d0.requests), len(d1.requests)]
                for _ in range(n):
                    status, body = await c.post({"prompt": "x"})
                    assert status == 200, body
                return [len(d0.requests) - before[0], len(d1.requests) - before[1]]

            assert await spread(2) == [1, 1]
            # Down: ejected (by the check or by the first failed call), then never picked.
            await d1.stop()
            await wait_for_health(c, "ok", "decode", d1.address, UNREACHABLE)
            assert await spread(4) == [4, 0]
            # Back on the same address: a check re-admits it and the turns include it again.
            await d1.restart()
            await wait_for_health(c, "ok", "decode", d1.address, "SERVING")
            assert await spread(2) == [1, 1]
            # Draining (NOT_SERVING): not picked, though it still answers.
            await d1.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            await wait_for_health(c, "ok", "decode", d1.address, "NOT_SERVING")
            assert await spread(3) == [3, 0]
            await d1.set_health(health_pb2.HealthCheckResponse.SERVING)
            await wait_for_health(c, "ok", "decode", d1.address, "SERVING")
            assert await spread(2) == [1, 1]
            labels = {"role": "decode", "address": d1.address}
            readmissions = "kvtransfer_router_daemon_readmissions_total"
            assert await metric_value(c, readmissions, **labels) == 2
            ejections = "kvtransfer_router_daemon_ejections_total"
            assert await metric_value(c, ejections, **labels, state="NOT_SERVING") == 1
            assert c.prefill.releases == []  # every decode finished: nothing to give back

    run(scenario)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(" re-admitted: SERVING" in m for m in messages) == 2, messages
    assert any(" ejected: NOT_SERVING (health check)" in m for m in messages), messages


def test_no_healthy_prefill_is_refused_before_the_decode_is_asked():
    async def scenario():
        async with cluster(health_interval_s=FAST_CHECKS) as c:
            p = c.prefill
            await p.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            body = await wait_for_health(c, "unavailable")
            assert body["prefill"] == {p.address: "NOT_SERVING"}
            assert (await c.get("/health"))[0] == 503
            status, answer = await c.post({"prompt": "x"})
            assert status == 503
            message = f"no prefill daemon is healthy ({p.address}: NOT_SERVING)"
            assert answer["error"]["message"] == message
            assert p.requests == [] and c.decode.requests == []

    run(scenario)


def test_config_and_flags_for_health_and_limits():
    good = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    for overrides, message in [
        ({"health_interval_s": 0}, "health_interval_s must be > 0, got 0"),
        ({"health_timeout_s": -1}, "health_timeout_s must be > 0, got -1"),
        ({"release_timeout_s": 0}, "release_timeout_s must be > 0, got 0"),
        ({"max_request_bytes": 0}, "max_request_bytes must be an integer >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            RouterConfig(**{**good, **overrides})
    defaults = RouterConfig(**good)
    assert (defaults.health_interval_s, defaults.health_timeout_s) == (1.0, 1.0)
    assert defaults.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 8 * 2**20
    argv = ["--prefill", "h:1", "--decode", "h:2", "--health-interval-s", "0.5"]
    argv += ["--health-timeout-s", "0.25", "--max-request-bytes", "1024"]
    config = config_from_args(_parser().parse_args(argv))
    assert (config.health_interval_s, config.health_timeout_s) == (0.5, 0.25)
    assert config.max_request_bytes == 1024
    options = dict(config.channel_options())
    limit = 1024 + GRPC_HEADROOM_BYTES
    assert options["grpc.max_send_message_length"] == limit
    assert options["grpc.max_receive_message_length"] == limit
    # A restarted daemon is reconnected to about as fast as it is checked.
    assert options["grpc.max_reconnect_backoff_ms"] == 500
    # A healed one too: pings replace a connection a partition left hanging, and connection
    # attempts end soon enough to be made again after the heal (never below the floors).
    assert options["grpc.min_reconnect_backoff_ms"] == 1000
    assert options["grpc.keepalive_time_ms"] == 1000
    assert options["grpc.keepalive_timeout_ms"] == 2000
    slow = RouterConfig(**{**good, "health_interval_s": 3.0, "health_timeout_s": 2.5})
    slow_options = dict(slow.channel_options())
    assert slow_options["grpc.keepalive_time_ms"] == 3000
    assert slow_options["grpc.keepalive_timeout_ms"] == 5000
    assert slow_options["grpc.min_reconnect_backoff_ms"] == 2500


# ---------------------------------------------------------------------- releases


@pytest.mark.parametrize(
    ("decode", "stream", "status"),
    [
        (fail(grpc.StatusCode.INVALID_ARGUMENT, "kv_transfer_params: bad"), False, 400),
        (fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "the pool has only 8"), False, 400),
        (finish_error("KV load failed"), False, 502),
        (finish_error("KV load failed", [([1], "ab")]), True, 200),  # SSE error event
        (decode_ok(finish_reason="abort"), False, 200),  # aborted: it may not have pulled
    ],
    ids=["invalid", "exhausted", "finish-error", "sse-error-event", "abort-finish"],
)
def test_a_decode_that_does_not_finish_releases_the_prefill_kv(decode, stream, status):
    async def scenario():
        async with cluster(decodes=[decode], health_interval_s=NO_CHECKS) as c:
            p = c.prefill
            if stream:
                response, raw = await post_stream(c, {"prompt": "x"})
                got = response.status
                assert "error" in json.loads(sse_events(raw)[-2])
            else:
                got, _ = await c.post({"prompt": "x"})
            assert got == status
            await p.released.wait()
            assert p.releases == [release_of(p, p.requests[0].request_id)]
            await released(c, "decode_failed", "released")
            # Not a transport failure: the decode daemon stays in the pool.
            assert (await c.get("/health"))[1]["decode"] == {c.decode.address: "SERVING"}

    run(scenario)


def test_a_finished_decode_releases_nothing():
    async def scenario():
        async with cluster(health_interval_s=NO_CHECKS) as c:
            assert (await c.post({"prompt": "x"}))[0] == 200
            response, _ = await post_stream(c, {"prompt": "x"})
            assert response.status == 200
            # Releases start inside the handler, before its answer: none started, none made.
            assert c.router.handlers.releases_in_flight == 0
            assert c.prefill.releases == []

    run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_that_goes_away_after_prefill_releases_the_kv(stream):
    async def scenario():
        async with cluster(decodes=[hang([([1], "a")])], health_interval_s=NO_CHECKS) as c:
            reader, writer = await raw_completion(c, {"prompt": "x", "stream": stream})
            await c.decode.received.wait()
            if stream:
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            writer.close()
            await writer.wait_closed()
            await c.decode.cancelled_event.wait()
            p = c.prefill
            await p.released.wait()
            assert p.releases == [release_of(p, p.requests[0].request_id)]
            await released(c, "client_gone", "released")

    run(scenario)


def test_a_release_never_delays_the_answer_and_has_a_deadline(caplog):
    caplog.set_level(logging.INFO, logger="kvtransfer.router")

    async def scenario():
        gate = asyncio.Event()
        refused = fail(grpc.StatusCode.INVALID_ARGUMENT, "no")
        async with cluster(
            decodes=[refused], health_interval_s=NO_CHECKS, release_timeout_s=0.2
        ) as c:
            p = c.prefill
            p.release_behaviour = release_gated(gate, release_answer())
            status, _ = await c.post({"prompt": "x"})
            # The answer came while the prefill still sits on the release.
            assert status == 400
            assert not gate.is_set()
            await released(c, "decode_failed", "DEADLINE_EXCEEDED")
            assert len(p.releases) == 1
            # A slow release is no sign of a dead daemon: it stays in the pool.
            assert (await c.get("/health"))[1]["prefill"] == {p.address: "SERVING"}
            gate.set()

    run(scenario)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("(decode_failed): DEADLINE_EXCEEDED" in m for m in messages), messages


def test_a_refused_release_is_counted_and_logged(caplog):
    caplog.set_level(logging.INFO, logger="kvtransfer.router")

    async def scenario():
        refused = fail(grpc.StatusCode.INVALID_ARGUMENT, "no")
        async with cluster(decodes=[refused], health_interval_s=NO_CHECKS) as c:
            p = c.prefill
            p.release_behaviour = release_fails(grpc.StatusCode.PERMISSION_DENIED, "secret")
            assert (await c.post({"prompt": "x"}))[0] == 400
            await released(c, "decode_failed", "PERMISSION_DENIED")
            p.release_behaviour = release_answer(False)
            assert (await c.post({"prompt": "x"}))[0] == 400
            await released(c, "decode_failed", "not_held")
            # Neither is a transport failure: the prefill stays in the pool.
            assert (await c.get("/health"))[1]["prefill"] == {p.address: "SERVING"}
            return p.requests[0].request_id

    request_id = asyncio.run(asyncio.wait_for(scenario(), 30))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "(decode_failed): PERMISSION_DENIED" in r.getMessage()
        and getattr(r, "request_id", None) == request_id
        for r in warnings
    ), [r.getMessage() for r in warnings]


# ---------------------------------------------------------------------- inputs


def nested(depth: int) -> str:
    """A JSON body nested ``depth`` levels deep, the body itself being level 1."""
    inner = depth - 2  # the body, and the list "x" holds
    return '{"prompt": "x", "x": ' + "[" * (inner + 1) + "]" * (inner + 1) + "}"


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (
            nested(MAX_JSON_DEPTH + 1).encode(),
            "the request body is JSON nested deeper than 64 levels",
            None,
        ),
        (
            ("[" * 100_000 + "]" * 100_000).encode(),
            "the request body is JSON nested deeper than 64 levels",
            None,
        ),
        (
            b'{"prompt": "a\\ud800b"}',
            "prompt: a string holds a lone surrogate (\\ud800), which is not valid Unicode",
            "prompt",
        ),
        (
            b'{"prompt": "x", "stop": ["ok", "\\udfff"]}',
            "stop[1]: a string holds a lone surrogate (\\udfff), which is not valid Unicode",
            "stop",
        ),
        (
            b'{"prompt": "x", "user": {"name": "\\uDBFF"}}',
            "user.name: a string holds a lone surrogate (\\udbff), which is not valid Unicode",
            "user",
        ),
        (
            b'{"prompt": "x", "\\ud800": 1}',
            "the request body: a key holds a lone surrogate (\\ud800), which is not valid Unicode",
            None,
        ),
        (
            b'{"prompt": "\xff"}',
            "the request body is not valid UTF-8: byte 0xff at offset 12 (invalid start byte)",
            None,
        ),
        (
            b"\xff\xfe",
            "the request body is not valid UTF-8: byte 0xff at offset 0 (invalid start byte)",
            None,
        ),
        (
            b'{"prompt": [' + b"1" * 5000 + b"]}",
            "the request body is not valid JSON: Exceeds the limit (4300 digits) for integer "
            "string conversion",
            None,
        ),
    ],
    ids=[
        "depth-65",
        "depth-100000",
        "surrogate-prompt",
        "surrogate-stop",
        "surrogate-ignored-field",
        "surrogate-key",
        "bad-utf8",
        "utf16-bom",
        "huge-int",
    ],
)
def test_deep_json_and_invalid_unicode_are_400s_naming_the_problem(raw, message, param):
    async def scenario():
        async with cluster() as c:
            status, answer = await c.post(raw=raw)
            assert status == 400, answer
            assert answer["error"]["message"].startswith(message), answer
            assert answer["error"]["param"] == param
            assert answer["error"]["type"] == "invalid_request_error"
            assert c.prefill.requests == c.decode.requests == []

    run(scenario)


def test_json_at_the_depth_limit_and_surrogate_pairs_are_fine():
    async def scenario():
        async with cluster() as c:
            status, answer = await c.post(raw=nested(MAX_JSON_DEPTH).encode())
            assert status == 200, answer
            status, answer = await c.post(raw=b'{"prompt": "smile \\ud83d\\ude00"}')
            assert status == 200, answer
            assert c.prefill.requests[-1].text == c.decode.requests[-1].text == "smile \U0001f600"

    run(scenario)


# ---------------------------------------------------------------------- size limits


def body_of(size: int) -> bytes:
    """A completions body of exactly ``size`` bytes (a long text prompt)."""
    frame = b'{"prompt": "", "max_tokens": 2}'
    raw = frame.replace(b'""', b'"' + b"x" * (size - len(frame)) + b'"')
    assert len(raw) == size
    return raw


def test_a_body_over_the_limit_is_413_and_one_at_the_limit_reaches_the_daemons():
    async def scenario():
        limit = 64 * 1024
        async with cluster(max_request_bytes=limit) as c:
            status, answer = await c.post(raw=body_of(limit + 1))
            assert (status, answer["error"]) == (
                413,
                {
                    "message": f"the request body is larger than {limit} bytes, this router's "
                    "limit (--max-request-bytes)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                },
            )
            assert c.prefill.requests == c.decode.requests == []
            status, answer = await c.post(raw=body_of(limit))
            assert status == 200, answer
            prompt = json.loads(body_of(limit))["prompt"]
            assert c.prefill.requests[0].text == c.decode.requests[0].text == prompt

    run(scenario)


def test_the_default_limit_holds_end_to_end_over_grpc():
    """Router and daemons share the default: a body just under it crosses both gRPC hops."""

    async def scenario():
        async with cluster() as c:
            status, answer = await c.post(raw=body_of(DEFAULT_MAX_REQUEST_BYTES + 1))
            assert status == 413
            assert f"larger than {DEFAULT_MAX_REQUEST_BYTES} bytes" in answer["error"]["message"]
            status, answer = await c.post(raw=body_of(DEFAULT_MAX_REQUEST_BYTES))
            assert status == 200, answer
            assert len(c.decode.requests[0].text) == DEFAULT_MAX_REQUEST_BYTES - 31

    run(scenario)


def test_daemons_with_a_smaller_limit_than_the_router_get_one_clear_413():
    async def scenario():
        daemon_limit = 2**20
        async with cluster(health_interval_s=NO_CHECKS) as c:
            for fake in c.prefills:
                await fake.stop()
                fake.max_request_bytes = daemon_limit
                await fake.restart()
            await c.router.handlers.fleet.check()
            status, answer = await c.post(raw=body_of(daemon_limit + GRPC_HEADROOM_BYTES + 1))
            assert status == 413, answer
            message = answer["error"]["message"]
            assert message.startswith(f"prefill daemon {c.prefill.address}: RESOURCE_EXHAUSTED: ")
            assert "larger than this daemon's gRPC message limit" in message
            assert message.endswith("give the router and every daemon the same --max-request-bytes")
            assert (await c.get("/health"))[0] == 200  # refused, not unreachable

    run(scenario)


async def _leave_during_prefill(c) -> None:
    """Send a request and hang up once the prefill daemon has it."""
    _, writer = await raw_completion(c, {"prompt": "x"})
    await c.prefill.received.wait()
    writer.close()
    await writer.wait_closed()


def test_a_client_that_leaves_as_the_prefill_ends_gets_its_kv_released():
    """The client leaves while the prefill's final message is on its way: the router still
    reads it (within the grace) and gives the KV back, instead of leaving it to the lease."""

    async def scenario():
        gate = asyncio.Event()
        async with cluster(health_interval_s=NO_CHECKS) as c:
            p = c.prefill
            p.behaviour = gated(gate, prefill_ok(p.address))
            await _leave_during_prefill(c)
            # The handler was cancelled (it records 499 as it unwinds); the grace runs now.
            await wait_for_metric(c, 'kvtransfer_router_requests_total{status="499"}')
            gate.set()
            await p.released.wait()
            assert p.releases == [release_of(p, p.requests[0].request_id)]
            assert p.cancelled == []
            assert c.decode.requests == []
            await released(c, "client_gone", "released")

    run(scenario)


def test_a_prefill_still_computing_when_the_client_leaves_is_cancelled():
    """Past the grace the prefill call is cancelled (the daemon aborts it and gives back
    anything it held); the router has no params, so it asks for no release."""

    async def scenario():
        async with cluster(health_interval_s=NO_CHECKS) as c:
            p = c.prefill
            p.behaviour = hang()
            await _leave_during_prefill(c)
            await asyncio.wait_for(p.cancelled_event.wait(), PREFILL_GRACE_S + 10)
            assert p.releases == []
            assert c.decode.requests == []

    run(scenario)
