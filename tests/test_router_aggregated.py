"""Aggregated instances (``--aggregated``: daemons that run whole requests themselves) in the
same router as prefill/decode pairs, against fake daemons (`router_helpers.fakes`): the decode
policy weighs them with the decodes, they never get KV from a prefill (nor a decode's retry
that carries it), they alone serve when no prefill is up, and the admin API adds them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from router_helpers.cluster import ADMIN_TOKEN, cluster, run, wait_for_health
from router_helpers.fakes import FakeDaemon, fail

from kvtransfer.router import RouterConfig

pytestmark = pytest.mark.integration

NO_CHECKS = 600.0


@asynccontextmanager
async def aggregated_daemon() -> AsyncIterator[FakeDaemon]:
    """A daemon that decodes alone (a fake decode daemon, listed as aggregated)."""
    fake = await FakeDaemon("decode").start()
    try:
        yield fake
    finally:
        await fake.stop()


def test_aggregated_instances_run_whole_requests_beside_pd_pairs() -> None:
    async def scenario() -> None:
        async with (
            aggregated_daemon() as agg,
            cluster(aggregated=(agg.address,), decode_policy="round_robin") as c,
        ):
            routes = []
            for _ in range(4):
                status, answer = await c.post({"prompt": "Hello", "max_tokens": 5})
                assert status == 200, answer
                routes.append(answer["kvtransfer"])
            on_agg = [r for r in routes if r["decode"] == agg.address]
            on_pd = [r for r in routes if r["decode"] == c.decode.address]
            assert len(on_agg) == len(on_pd) == 2  # round robin over both kinds
            assert all("prefill" not in r for r in on_agg)
            assert all(r["prefill"] == c.prefill.address for r in on_pd)
            # The aggregated daemon computed its prompts: no KV params, no first token given.
            assert len(agg.requests) == 2
            for request in agg.requests:
                assert request.kv_transfer_params_json == ""
                assert list(request.generated_token_ids) == []
            assert len(c.prefill.requests) == 2
            _, text = await c.get("/metrics")
            assert 'kvtransfer_router_routes_total{mode="aggregated"} 2.0' in text
            assert 'kvtransfer_router_routes_total{mode="disaggregated"} 2.0' in text

    run(scenario)


def test_without_a_prefill_only_aggregated_instances_serve() -> None:
    async def scenario() -> None:
        async with (
            aggregated_daemon() as agg,
            cluster(prefills=(), aggregated=(agg.address,), health_interval_s=0.05) as c,
        ):
            health = await wait_for_health(c, "ok")
            assert health["aggregated"] == {agg.address: "SERVING"}
            assert health["decode"] == {c.decode.address: "SERVING"}
            for _ in range(3):
                status, answer = await c.post({"prompt": "Hello", "max_tokens": 5})
                assert status == 200, answer
                assert answer["kvtransfer"]["decode"] == agg.address
            assert c.decode.requests == []  # it needs a prefill's KV, and there is none
            await agg.stop()
            await wait_for_health(c, "unavailable")
            status, answer = await c.post({"prompt": "Hello", "max_tokens": 5})
            assert status == 503
            assert answer["error"]["message"].startswith("no prefill daemon is healthy")

    run(scenario)


def test_a_decode_retry_with_a_prefills_kv_never_goes_to_an_aggregated_instance() -> None:
    async def scenario() -> None:
        down = fail(grpc.StatusCode.UNAVAILABLE, "Connection refused")
        async with (
            aggregated_daemon() as agg,
            # Round robin's first pick is the decode daemon (listed before the aggregated one).
            cluster(
                decodes=[down],
                aggregated=(agg.address,),
                decode_policy="round_robin",
                health_interval_s=NO_CHECKS,
            ) as c,
        ):
            status, answer = await c.post({"prompt": "Hello", "max_tokens": 5})
            assert status == 503, answer
            assert answer["error"]["message"].startswith(f"decode daemon {c.decode.address}")
            assert agg.requests == []
            assert len(c.prefill.requests) == 1
            await c.prefill.released.wait()  # the KV nobody pulled is given back
            assert len(c.prefill.releases) == 1

    run(scenario)


def test_the_admin_api_adds_an_aggregated_instance() -> None:
    async def scenario() -> None:
        async with aggregated_daemon() as agg, cluster(admin_token=ADMIN_TOKEN) as c:
            status, body = await c.admin(
                "POST", "/workers", body={"address": agg.address, "role": "aggregated"}
            )
            assert status == 201, body
            assert (body["role"], body["state"]) == ("aggregated", "SERVING")
            workers = await c.workers()
            assert workers[agg.address]["role"] == "aggregated"
            assert workers[c.decode.address]["role"] == "decode"
            status, body = await c.admin(
                "POST", "/workers", body={"address": "127.0.0.1:1", "role": "both"}
            )
            assert status == 400
            message = body["error"]["message"]
            assert message == "role: must be 'prefill', 'decode' or 'aggregated', got 'both'"

    run(scenario)


def test_aggregated_addresses_are_checked_with_the_others() -> None:
    assert RouterConfig(prefill=(), decode=(), aggregated=("h:1",)).aggregated == ("h:1",)
    with pytest.raises(ValueError, match="h:1: listed as both a decode and an aggregated daemon"):
        RouterConfig(prefill=("h:2",), decode=("h:1",), aggregated=("h:1",))
    with pytest.raises(ValueError, match="at least one prefill daemon is required"):
        RouterConfig(prefill=(), decode=("h:1",))
    with pytest.raises(ValueError, match="is not HOST:PORT or dns:NAME:PORT"):
        RouterConfig(prefill=(), decode=(), aggregated=("nohost",))
