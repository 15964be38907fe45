"""The router's fleet against fake daemons (`router_helpers.fakes`): instances added and removed
at run time through the admin API (behind its token) and through DNS; picks that follow the
router's in-flight count and the daemons' reported load; a phase that failed having sent nothing
retried on another instance; circuit breakers; the admission queue; an early decode that ends
while its prefill hangs; short known prompts decoded alone; the per-instance metrics. Policies,
breakers and the queue alone: tests/test_router_policy.py."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
from router_helpers.cluster import (
    ADMIN_TOKEN,
    WAIT_S,
    Cluster,
    cluster,
    run,
    wait_for_health,
    wait_for_metric,
)
from router_helpers.fakes import (
    DECODE_PIECES,
    FIRST_PIECE,
    FakeDaemon,
    Reply,
    decode_ok,
    fail,
    finish_error,
    gated,
    hang,
    load_status,
    params_for,
    prefill_announces_then_hangs,
    prefill_ok,
)
from waiting import wait_until_async

from kvtransfer.router.routing.policy import RouteContext

pytestmark = pytest.mark.integration

NO_CHECKS = 600.0
FAST_CHECKS = 0.05
DECODE_TEXT = FIRST_PIECE[1] + "".join(text for _, text in DECODE_PIECES)


async def route_of(c: Cluster, body: dict[str, Any] | None = None) -> dict[str, Any]:
    status, answer = await c.post(body or {"prompt": "x"})
    assert status == 200, answer
    return answer["kvtransfer"]


async def wait_for_workers(c: Cluster, what: str, check: Any) -> dict[str, dict[str, Any]]:
    async def seen() -> dict[str, dict[str, Any]] | None:
        workers = await c.workers()
        return workers if check(workers) else None

    return await wait_until_async(seen, what, WAIT_S)


async def wait_for(check: Any, what: str) -> Any:
    """Polls a plain ``check()`` until it is truthy (what the test's own tasks change)."""

    async def probe() -> Any:
        return check()

    return await wait_until_async(probe, what, WAIT_S)


def metric_line(name: str, value: float, **labels: str) -> str:
    inside = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inside}}} {float(value)}"


# ---------------------------------------------------------------------- the admin API


def test_the_admin_api_is_off_without_a_token_and_needs_the_right_one():
    async def scenario():
        async with cluster() as c:
            for method, path in [("GET", "/workers"), ("POST", "/workers"), ("DELETE", "/x")]:
                status, body = await c.admin(method, path if method != "DELETE" else "/workers/x")
                assert status == 403, body
                assert body["error"]["message"].startswith("the admin API is disabled: start ")
        async with cluster(admin_token=ADMIN_TOKEN) as c:
            for token, message in [
                (None, "missing admin token (send 'Authorization: Bearer <token>')"),
                ("guess", "wrong admin token"),
                (ADMIN_TOKEN + "x", "wrong admin token"),
            ]:
                for method in ("GET", "POST"):
                    status, body = await c.admin(method, "/workers", token=token)
                    assert (status, body["error"]["message"]) == (401, message)
            async with c.http.get(
                "/workers", headers={"Authorization": f"Basic {ADMIN_TOKEN}"}
            ) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == "Bearer"
            # A refused POST changed nothing.
            assert set(await c.workers()) == {c.prefill.address, c.decode.address}

    run(scenario)


def test_a_refused_delete_leaves_the_instance_in_the_fleet():
    async def scenario():
        async with cluster(admin_token=ADMIN_TOKEN) as c:
            path = f"/workers/{c.prefill.address}"
            for token, message in [
                (None, "missing admin token (send 'Authorization: Bearer <token>')"),
                ("guess", "wrong admin token"),
                (ADMIN_TOKEN + "x", "wrong admin token"),
            ]:
                status, body = await c.admin("DELETE", path, token=token)
                assert (status, body["error"]["message"]) == (401, message)
            async with c.http.delete(
                path, headers={"Authorization": f"Basic {ADMIN_TOKEN}"}
            ) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == "Bearer"
            assert set(await c.workers()) == {c.prefill.address, c.decode.address}
            assert (await route_of(c))["prefill"] == c.prefill.address
        async with cluster() as c:
            status, body = await c.admin("DELETE", f"/workers/{c.prefill.address}")
            assert status == 403, body
            assert body["error"]["code"] == "admin_api_disabled"
            assert (await c.get("/health"))[1]["prefill"] == {c.prefill.address: "SERVING"}
            assert (await route_of(c))["prefill"] == c.prefill.address

    run(scenario)


def test_workers_are_added_and_removed_while_requests_run():
    async def scenario():
        p0 = await FakeDaemon("prefill").start()
        p1 = await FakeDaemon("prefill").start()
        try:
            async with cluster(prefills=[], admin_token=ADMIN_TOKEN) as c:
                # No prefill yet: 503 naming the empty role, with Retry-After; nothing sent.
                async with c.http.post("/v1/completions", json={"prompt": "x"}) as response:
                    answer = await response.json()
                    assert response.status == 503
                    assert int(response.headers["Retry-After"]) >= 1
                assert answer["error"]["message"] == (
                    "no prefill daemon is healthy (the fleet has no prefill daemon yet)"
                )
                assert c.decode.requests == []
                assert (await c.get("/health"))[0] == 503

                # Bodies that are not a worker: 400 naming the problem, nothing added.
                for body, param, message in [
                    ([1], None, "the body must be a JSON object"),
                    ({"address": p0.address}, "role", "role: required"),
                    ({"address": p0.address, "role": "both"}, "role", "role: must be"),
                    ({"address": "nohost", "role": "prefill"}, "address", "address: 'nohost'"),
                    (
                        {"address": "<img src=x>:80", "role": "prefill"},
                        "address",
                        "address: '<img src=x>:80' is not HOST:PORT: its host may hold only",
                    ),
                    ({"address": 5, "role": "prefill"}, "address", "address: must be a string"),
                    ({"address": p0.address, "role": "prefill", "x": 1}, "x", "unknown field"),
                ]:
                    status, answer = await c.admin("POST", "/workers", body=body)
                    assert status == 400, (body, answer)
                    assert answer["error"]["message"].startswith(message), answer
                    assert answer["error"]["param"] == param
                async with c.http.post(
                    "/workers", data=b"{", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                ) as response:
                    assert response.status == 400
                    assert "the body is not JSON" in (await response.json())["error"]["message"]
                assert set(await c.workers()) == {c.decode.address}

                # Added: checked before the answer, so picked by the very next request.
                status, worker = await c.admin(
                    "POST", "/workers", body={"address": p0.address, "role": "prefill"}
                )
                assert status == 201, worker
                assert worker | {"picks": 0} == {
                    "address": p0.address,
                    "role": "prefill",
                    "source": "admin",
                    "state": "SERVING",
                    "healthy": True,
                    "breaker": "closed",
                    "pickable": True,
                    "in_flight": 0,
                    "picks": 0,
                    "load": None,
                    # Nothing measured yet: no call was routed to it.
                    "service": {
                        "prompt_tokens_per_s": None,
                        "queued_prompt_tokens": 0,
                        "decoding": 0,
                        "server_running": 0,
                        "itl_source": "router",
                        "inter_token_s_by_batch": {},
                        "alone_gap_s": None,
                    },
                }
                assert (await route_of(c))["prefill"] == p0.address
                for address, role, message in [
                    (p0.address, "prefill", f"{p0.address} is in the fleet already (as a prefill)"),
                    (c.decode.address, "prefill", "is in the fleet already (as a decode)"),
                ]:
                    body = {"address": address, "role": role}
                    status, answer = await c.admin("POST", "/workers", body=body)
                    assert status == 409 and message in answer["error"]["message"], answer

                # Removed while a request runs on it: that one finishes there, no new one
                # picks it.
                gate = asyncio.Event()
                p0.behaviour = gated(gate, prefill_ok(p0.address))
                p0.received.clear()
                held = asyncio.create_task(c.post({"prompt": "held"}))
                await p0.received.wait()
                body = {"address": p1.address, "role": "prefill"}
                assert (await c.admin("POST", "/workers", body=body))[0] == 201
                status, removed = await c.admin("DELETE", f"/workers/{p0.address}")
                assert status == 200, removed
                assert (removed["address"], removed["in_flight"]) == (p0.address, 1)
                before = len(p0.requests)
                for _ in range(3):
                    assert (await route_of(c))["prefill"] == p1.address
                assert len(p0.requests) == before
                gate.set()
                status, answer = await held
                assert status == 200 and answer["kvtransfer"]["prefill"] == p0.address
                assert set(await c.workers()) == {p1.address, c.decode.address}
                status, answer = await c.admin("DELETE", f"/workers/{p0.address}")
                assert (status, answer["error"]["message"]) == (
                    404,
                    f"{p0.address} is not in the fleet",
                )
                _, text = await c.get("/metrics")
                assert f'address="{p0.address}"' not in text.split("kvtransfer_router_fleet")[0]
                for change, count in (("added", 2), ("removed", 1)):
                    line = metric_line(
                        "kvtransfer_router_fleet_changes_total",
                        count,
                        role="prefill",
                        change=change,
                        source="admin",
                    )
                    assert line in text.splitlines(), line
        finally:
            await p0.stop()
            await p1.stop()

    run(scenario)


# ---------------------------------------------------------------------- DNS


def test_a_dns_name_fills_and_empties_its_role():
    """One name, one port, several addresses: fakes on 127.0.0.1 and 127.0.0.2 share a port,
    as a headless Service's pods do; the resolver is the test's."""

    async def scenario():
        first = await FakeDaemon("decode").start()
        port = int(first.address.rsplit(":", 1)[1])
        second = await FakeDaemon("decode", host="127.0.0.2").start(port)
        answers: list[Any] = [[]]
        asked: list[str] = []

        async def resolver(name: str, at: int) -> list[str]:
            asked.append(f"{name}:{at}")
            answer = answers[-1]
            if isinstance(answer, BaseException):
                raise answer
            return answer

        async def decodes(c: Cluster) -> set[str]:
            return set((await c.get("/health"))[1]["decode"])

        try:
            async with cluster(
                decodes=[],
                extra_decode=[f"dns:decode.pd.svc:{port}"],
                resolver=resolver,
                dns_interval_s=0.05,
            ) as c:
                assert asked[0] == f"decode.pd.svc:{port}"
                status, answer = await c.post({"prompt": "x"})
                assert status == 503, answer
                assert "the fleet has no decode daemon yet" in answer["error"]["message"]
                assert c.prefill.requests == []

                answers.append(["127.0.0.1"])
                await wait_for_health(c, "ok")
                assert (await route_of(c))["decode"] == first.address
                answers.append(["127.0.0.1", "127.0.0.2"])
                await wait_for_health(c, "ok", "decode", second.address, "SERVING")
                routes = {(await route_of(c))["decode"] for _ in range(2)}
                assert routes == {first.address, second.address}

                # A resolver that fails for a while keeps what the name gave last.
                answers.append(socket.gaierror(socket.EAI_AGAIN, "Temporary failure"))
                count = len(asked)
                await wait_for(lambda: len(asked) > count + 2, "resolutions")
                assert await decodes(c) == {first.address, second.address}
                # A name that no longer exists (no ready pod): its instances go.
                answers.append(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
                await wait_for_health(c, "unavailable")
                assert await decodes(c) == set()
                answers.append(["127.0.0.2"])
                await wait_for_health(c, "ok")
                assert await decodes(c) == {second.address}
        finally:
            await first.stop()
            await second.stop()

    run(scenario)


def test_a_dns_name_resolved_for_real():
    async def scenario():
        fake = await FakeDaemon("decode").start()
        port = fake.address.rsplit(":", 1)[1]
        try:
            async with cluster(decodes=[], extra_decode=[f"dns:localhost:{port}"]) as c:
                await wait_for_health(c, "ok")
                assert (await route_of(c))["decode"] == fake.address
                # localhost may also be ::1, where nothing listens: named, never picked.
                states = (await c.get("/health"))[1]["decode"]
                assert states[fake.address] == "SERVING"
                assert set(states) <= {fake.address, f"[::1]:{port}"}
        finally:
            await fake.stop()

    run(scenario)


# ---------------------------------------------------------------------- policies and load


def test_least_load_follows_in_flight_calls_and_reported_load():
    async def scenario():
        async with cluster(
            decodes=[None, None],
            health_interval_s=FAST_CHECKS,
            admin_token=ADMIN_TOKEN,
            prefill_policy="round_robin",
        ) as c:
            d0, d1 = c.decodes
            _, body = await c.admin("GET", "/workers")
            assert body["policies"] == {"prefill": "round_robin", "decode": "least_load"}
            # Idle and reporting nothing: in turn.
            assert [(await route_of(c))["decode"] for _ in range(2)] == [d0.address, d1.address]

            # A request in flight on d0: the next ones go to d1.
            gate = asyncio.Event()
            d0.behaviour = gated(gate, decode_ok())
            d0.received.clear()
            held = asyncio.create_task(c.post({"prompt": "held"}))
            await d0.received.wait()
            workers = await c.workers()
            assert (workers[d0.address]["in_flight"], workers[d1.address]["in_flight"]) == (1, 0)
            assert [(await route_of(c))["decode"] for _ in range(3)] == [d1.address] * 3
            gate.set()
            assert (await held)[0] == 200

            # Reports: d0 busy with other routers' requests, d1 idle.
            d0.status = load_status(running=3, waiting=2, used=40, free=24)
            d1.status = load_status()
            await wait_for_workers(
                c,
                "both loads read",
                lambda w: w[d0.address]["load"] is not None and w[d1.address]["load"] is not None,
            )
            assert [(await route_of(c))["decode"] for _ in range(3)] == [d1.address] * 3
            d0.status, d1.status = load_status(), load_status(running=1, waiting=1)
            await wait_for_workers(
                c, "d1 busier", lambda w: (w[d1.address]["load"] or {}).get("running") == 1
            )
            assert (await route_of(c))["decode"] == d0.address

            workers = await c.workers()
            assert workers[d1.address]["load"] == {
                "running": 1,
                "waiting": 1,
                "kv_blocks_used": 0,
                "kv_blocks_total": 64,
            }
            _, text = await c.get("/metrics")
            lines = text.splitlines()
            labels = {"role": "decode", "address": d1.address}
            breaker = "kvtransfer_router_instance_breaker_state"
            for line in [
                metric_line("kvtransfer_router_instance_picks_total", 7, **labels),
                metric_line("kvtransfer_router_instance_in_flight", 0, **labels),
                metric_line("kvtransfer_router_instance_requests", 1, **labels, state="running"),
                metric_line("kvtransfer_router_instance_kv_blocks", 64, **labels, kind="total"),
                metric_line(breaker, 1, **labels, state="closed"),
                metric_line(breaker, 0, **labels, state="open"),
            ]:
                assert line in lines, line

    run(scenario)


# ---------------------------------------------------------------------- retries and breakers


def prefill_announcing_at(address: str, gate: asyncio.Event) -> Any:
    """A prefill that announces its params, waits for ``gate``, then returns its first
    token."""

    async def behaviour(request, context):
        params = params_for(address, request.request_id)
        yield Reply(request_id=request.request_id, num_prompt_tokens=5)
        yield Reply(request_id=request.request_id, kv_transfer_params_json=params)
        await gate.wait()
        yield Reply(
            request_id=request.request_id,
            token_ids=FIRST_PIECE[0],
            text=FIRST_PIECE[1],
            finished=True,
            finish_reason="length",
            kv_transfer_params_json=params,
        )

    return behaviour


def test_a_phase_that_sent_nothing_is_retried_on_another_instance():
    async def scenario():
        down = fail(grpc.StatusCode.UNAVAILABLE, "Connection refused")
        async with cluster(
            prefills=[fail(grpc.StatusCode.INTERNAL, "engine died"), None],
            decodes=[down, None],
            health_interval_s=NO_CHECKS,
            policy="round_robin",
        ) as c:
            (p0, p1), (d0, d1) = c.prefills, c.decodes
            status, answer = await c.post({"prompt": "x"})
            assert status == 200, answer
            assert answer["choices"][0]["text"] == DECODE_TEXT
            info = answer["kvtransfer"]
            assert (info["prefill"], info["decode"]) == (p1.address, d1.address)
            (pre0,), (pre1,) = p0.requests, p1.requests
            assert pre0.request_id == pre1.request_id == info["request_id"]
            # The decode retried elsewhere got p1's params and first token, as d0 had.
            (dec0,), (dec1,) = d0.requests, d1.requests
            assert dec1.kv_transfer_params_json == params_for(p1.address, info["request_id"])
            assert dec0.kv_transfer_params_json == dec1.kv_transfer_params_json
            assert list(dec1.generated_token_ids) == FIRST_PIECE[0]
            assert p1.releases == []
            _, text = await c.get("/metrics")
            for role, reason in (("prefill", "INTERNAL"), ("decode", "UNAVAILABLE")):
                line = metric_line("kvtransfer_router_retries_total", 1, role=role, reason=reason)
                assert line in text.splitlines(), line

            # An early decode that fails before answering moves to another decode instance
            # while the prefill still computes; the first token reaches it through Continue.
            await c.router.handlers.fleet.check()
            gate = asyncio.Event()
            p0.behaviour = prefill_announcing_at(p0.address, gate)
            p1.behaviour = prefill_announcing_at(p1.address, gate)
            d0.requests.clear()
            d1.requests.clear()
            task = asyncio.create_task(c.post({"prompt": "y", "max_tokens": 5}))
            await wait_for(lambda: d0.requests and d1.requests, "both decodes")
            assert d1.requests[0].await_generated_tokens
            gate.set()
            status, answer = await task
            assert status == 200, answer
            assert answer["kvtransfer"]["decode"] == d1.address
            (cont,) = d1.continues
            assert list(cont.generated_token_ids) == FIRST_PIECE[0]
            # Every lease ended, the prefill's too (it was once ended in d1's place, so p0's
            # in_flight stayed at 1 for good: a half-open breaker never saw it idle).
            for role, fake in (("prefill", p0), ("prefill", p1), ("decode", d0), ("decode", d1)):
                idle = metric_line(
                    "kvtransfer_router_instance_in_flight", 0, role=role, address=fake.address
                )
                await wait_for_metric(c, idle)

        # --max-retries 0: the first failure is the answer.
        async with cluster(
            prefills=[fail(grpc.StatusCode.INTERNAL, "engine died"), None],
            policy="round_robin",
            max_retries=0,
        ) as c:
            status, answer = await c.post({"prompt": "x"})
            assert status == 502, answer
            assert answer["error"]["message"] == (
                f"prefill daemon {c.prefills[0].address}: INTERNAL: engine died"
            )
            assert c.prefills[1].requests == []

    run(scenario)


def _failing_prefill_first(**config: Any) -> Any:
    """Two prefills picked in turn, the first failing every call; breakers open after 2."""
    return cluster(
        prefills=[fail(grpc.StatusCode.INTERNAL, "engine died"), None],
        policy="round_robin",
        breaker_failures=2,
        admin_token=ADMIN_TOKEN,
        **config,
    )


def test_a_circuit_breaker_opens_after_failures_and_closes_after_a_good_trial():
    async def scenario():
        async with _failing_prefill_first(breaker_cooldown_s=0.3) as c:
            p0, p1 = c.prefills
            # Health SERVING throughout: only the breaker can take p0 out.
            for _ in range(2):
                assert (await route_of(c))["prefill"] == p1.address
            workers = await c.workers()
            assert (workers[p0.address]["breaker"], workers[p0.address]["pickable"]) == (
                "open",
                False,
            )
            states = (await c.get("/health"))[1]["prefill"]
            assert states[p0.address] == "SERVING, breaker open"
            for _ in range(3):
                assert (await route_of(c))["prefill"] == p1.address
            assert len(p0.requests) == 2

            p0.behaviour = prefill_ok(p0.address)
            await wait_for_workers(
                c, "p0 half-open", lambda w: w[p0.address]["breaker"] == "half_open"
            )
            routes = [(await route_of(c))["prefill"] for _ in range(2)]
            assert p0.address in routes
            assert (await c.workers())[p0.address]["breaker"] == "closed"
            _, text = await c.get("/metrics")
            labels = {"role": "prefill", "address": p0.address}
            for state in ("open", "half_open", "closed"):
                line = metric_line(
                    "kvtransfer_router_breaker_transitions_total", 1, **labels, state=state
                )
                assert line in text.splitlines(), line

    run(scenario)


def test_a_breaker_opened_by_calls_an_outage_cut_closes_when_the_daemon_is_back():
    """A partition ends every call in flight at once (keep-alive pings close the connection):
    failures of calls that found the daemon unreachable open its breaker like any, but once a
    health check takes it back they are forgotten (a healed prefill stayed out 30 s)."""

    async def scenario():
        async with cluster(
            prefills=[fail(grpc.StatusCode.UNAVAILABLE, "Connection timed out"), None],
            policy="round_robin",
            breaker_failures=2,
            breaker_cooldown_s=600.0,
            health_interval_s=NO_CHECKS,
            admin_token=ADMIN_TOKEN,
        ) as c:
            p0, p1 = c.prefills
            fleet = c.router.handlers.fleet
            for attempt in range(2):
                # Each call to p0 fails unreachable (ejected, retried on p1); a check takes it
                # back, as it answers its health checks.
                before = len(p0.requests)
                while len(p0.requests) == before:
                    assert (await route_of(c))["prefill"] == p1.address
                opened = (await c.workers())[p0.address]["breaker"]
                assert opened == ("closed" if attempt == 0 else "open")
                await fleet.check()
            assert (await c.workers())[p0.address]["breaker"] == "closed"
            assert fleet.get(p0.address).breaker.consecutive_failures == 0
            p0.behaviour = prefill_ok(p0.address)
            routes = {(await route_of(c))["prefill"] for _ in range(2)}
            assert routes == {p0.address, p1.address}

    run(scenario)


def test_a_daemon_that_restarted_gets_its_breaker_closed_at_once():
    """Failures belong to a process: a daemon whose uptime went back is a new one, and need not
    wait out the cooldown (here ten minutes); the old process's uptime growing changes nothing."""

    def status(uptime_s: float) -> Any:
        answer = load_status()
        answer.uptime_s = uptime_s
        return answer

    async def scenario():
        async with _failing_prefill_first(
            breaker_cooldown_s=600.0, health_interval_s=NO_CHECKS
        ) as c:
            p0, p1 = c.prefills
            fleet = c.router.handlers.fleet
            p0.status = status(100.0)
            await fleet.check()
            for _ in range(2):
                assert (await route_of(c))["prefill"] == p1.address
            assert (await c.workers())[p0.address]["breaker"] == "open"
            # Still the same process (it answers again, its uptime grew): still out.
            p0.behaviour = prefill_ok(p0.address)
            p0.status = status(130.0)
            await fleet.check()
            assert (await c.workers())[p0.address]["breaker"] == "open"
            assert {(await route_of(c))["prefill"] for _ in range(2)} == {p1.address}
            # Restarted: uptime 2 s.
            p0.status = status(2.0)
            await fleet.check()
            assert (await c.workers())[p0.address]["breaker"] == "closed"
            routes = {(await route_of(c))["prefill"] for _ in range(2)}
            assert routes == {p0.address, p1.address}

    run(scenario)


# ---------------------------------------------------------------------- admission


def test_requests_beyond_the_running_and_queued_limits_get_429():
    async def scenario():
        gate = asyncio.Event()
        async with cluster(
            decodes=[gated(gate, decode_ok())], max_concurrent_requests=1, max_queued_requests=1
        ) as c:
            running = asyncio.create_task(c.post({"prompt": "a"}))
            await c.decode.received.wait()
            queued = asyncio.create_task(c.post({"prompt": "b"}))
            await wait_for_metric(c, "kvtransfer_router_requests_queued 1.0")
            async with c.http.post("/v1/completions", json={"prompt": "c"}) as response:
                answer = await response.json()
                assert response.status == 429
                assert response.headers["Retry-After"] == "1"
            assert answer["error"]["type"] == "rate_limit_error"
            assert "--max-concurrent-requests" in answer["error"]["message"]
            assert [r.text for r in c.prefill.requests] == ["a"]
            gate.set()
            assert [(await t)[0] for t in (running, queued)] == [200, 200]
            assert [r.text for r in c.prefill.requests] == ["a", "b"]
            await wait_for_metric(c, "kvtransfer_router_requests_running 0.0")

    run(scenario)


# ---------------------------------------------------------------------- legs that end early


@pytest.mark.parametrize(
    ("decode", "status", "message"),
    [
        (finish_error("KV load failed for request: producer unreachable"), 502, "KV load failed"),
        (fail(grpc.StatusCode.UNAVAILABLE, "Connection reset"), 503, "UNAVAILABLE: Connection"),
    ],
    ids=["load-failed", "decode-down"],
)
def test_an_early_decode_that_ends_while_its_prefill_hangs_ends_the_request(
    decode, status, message
):
    """The prefill announced its KV and then hangs (a wedged engine): the decode's failure is
    the answer at once, not the prefill's deadline much later; the prefill is cancelled."""

    async def scenario():
        async with cluster(decodes=[decode], health_interval_s=NO_CHECKS) as c:
            p, d = c.prefill, c.decode
            p.behaviour = prefill_announces_then_hangs(p.address)
            got, answer = await c.post({"prompt": "x"})
            assert got == status, answer
            assert answer["error"]["message"].startswith(f"decode daemon {d.address}: {message}")
            assert d.requests[0].await_generated_tokens
            await p.cancelled_event.wait()
            assert p.cancelled == [p.requests[0].request_id]
            # The prefill did nothing wrong: it stays in the pool.
            assert (await c.get("/health"))[1]["prefill"] == {p.address: "SERVING"}

    run(scenario)


def test_a_client_that_leaves_cancels_both_legs():
    async def scenario():
        async with cluster(decodes=[hang()], health_interval_s=NO_CHECKS) as c:
            p, d = c.prefill, c.decode
            p.behaviour = prefill_announces_then_hangs(p.address)
            task = asyncio.create_task(c.post({"prompt": "x"}))
            await d.received.wait()
            task.cancel()
            await asyncio.gather(p.cancelled_event.wait(), d.cancelled_event.wait())
            workers = c.router.handlers.fleet.instances()
            await wait_for(lambda: all(w.in_flight == 0 for w in workers), "leases ended")

    run(scenario)


# ---------------------------------------------------------------------- decode alone


class _Estimator:
    """A decode policy that also estimates the uncached part (as cache_aware may)."""

    name = "estimating"

    def __init__(self, uncached: int) -> None:
        self.uncached = uncached

    def choose(self, candidates, route: RouteContext):
        return candidates[0]

    def observe(self, chosen, route: RouteContext) -> None:
        return None

    def uncached_tokens(self, candidates, route: RouteContext) -> int:
        return self.uncached


def test_a_short_known_prompt_runs_on_a_decode_daemon_alone():
    def tokenizer(prompt: Any) -> list[int] | None:
        if isinstance(prompt, tuple):
            return list(prompt)
        return [7] * len(prompt) if isinstance(prompt, str) else None

    async def scenario():
        async with cluster(disagg_min_prompt_tokens=8, tokenizer=tokenizer) as c:
            p, d = c.prefill, c.decode
            status, answer = await c.post({"prompt": [1, 2, 3], "max_tokens": 7})
            assert status == 200, answer
            assert p.requests == []
            (alone,) = d.requests
            assert list(alone.token_ids.ids) == [1, 2, 3]
            assert alone.kv_transfer_params_json == ""
            assert list(alone.generated_token_ids) == []
            assert not alone.await_generated_tokens
            assert alone.sampling.max_tokens == 7
            text = "".join(t for _, t in DECODE_PIECES)
            assert answer["choices"][0]["text"] == text
            info = answer["kvtransfer"]
            assert info["decode"] == d.address and "prefill" not in info
            # Long enough, or a text the tokenizer counts long: prefill then decode.
            for prompt in (list(range(8)), "x" * 8):
                assert (await route_of(c, {"prompt": prompt}))["prefill"] == p.address
            assert (await route_of(c, {"prompt": "short"}))["decode"] == d.address
            assert len(p.requests) == 2
            # The decode policy's estimate decides when it makes one.
            c.router.handlers.fleet.policies["decode"] = _Estimator(uncached=100)
            assert "prefill" in await route_of(c, {"prompt": [1, 2]})
            c.router.handlers.fleet.policies["decode"] = _Estimator(uncached=1)
            assert "prefill" not in await route_of(c, {"prompt": list(range(50))})
            _, text = await c.get("/metrics")
            for mode, count in (("decode_only", 3), ("disaggregated", 3)):
                line = metric_line("kvtransfer_router_routes_total", count, mode=mode)
                assert line in text.splitlines(), line

    run(scenario)


def test_a_decode_alone_is_retried_before_its_first_message():
    async def scenario():
        down = fail(grpc.StatusCode.UNAVAILABLE, "Connection refused")
        async with cluster(
            decodes=[down, None], disagg_min_prompt_tokens=8, health_interval_s=NO_CHECKS
        ) as c:
            d0, d1 = c.decodes
            answer = await route_of(c, {"prompt": [1, 2, 3]})
            assert answer["decode"] == d1.address
            assert len(d0.requests) == len(d1.requests) == 1
            # Once it answered, a failure is the request's: no retry.
            for fake in (d0, d1):
                fake.behaviour = finish_error("engine died", [([1], "a")])
            await c.router.handlers.fleet.check()
            status, answer = await c.post({"prompt": [1, 2, 3]})
            assert status == 502 and "engine died" in answer["error"]["message"], answer
            assert len(d0.requests) + len(d1.requests) == 3

    run(scenario)
