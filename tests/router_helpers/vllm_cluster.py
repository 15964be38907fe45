"""A router with ``engine="vllm"`` in front of stand-in vLLM servers (`fake_vllm.FakeVllm`),
with an HTTP client, for tests: ``async with vllm_cluster([prefill()], [decode()]) as c``.

An entry is a `VllmBehaviour` (a plain `FakeVllm` is started with it) or a `FakeVllm` (or a
subclass) to start as it is. The router's admin API is on (`cluster.ADMIN_TOKEN`), so
`VllmCluster.workers` reads the fleet.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from waiting import wait_until_async

from kvtransfer.router import RouterConfig, RouterServer
from router_helpers.cluster import ADMIN_TOKEN, WAIT_S
from router_helpers.fake_vllm import FakeVllm, VllmBehaviour, prefill_ok

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def prefill() -> VllmBehaviour:
    """A good vLLM prefill: one token and its kv_transfer_params."""
    return VllmBehaviour(completions=prefill_ok)


def decode() -> VllmBehaviour:
    """A good vLLM decode: JSON or events as asked."""
    return VllmBehaviour()


@dataclass
class VllmCluster:
    router: RouterServer
    http: aiohttp.ClientSession
    prefills: list[FakeVllm]
    decodes: list[FakeVllm]
    aggregated: list[FakeVllm] = field(default_factory=list)

    async def post(
        self, body: Any, path: str = "/v1/completions", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, Any]:
        async with self.http.post(path, json=body, headers=headers) as response:
            return response.status, await response.read(), response.headers

    async def workers(self) -> dict[str, dict[str, Any]]:
        """``GET /workers`` as address -> worker."""
        async with self.http.get("/workers", headers=ADMIN_HEADERS) as response:
            assert response.status == 200
            return {w["address"]: w for w in (await response.json())["workers"]}

    async def metrics_text(self) -> str:
        """The router's ``/metrics`` page."""
        async with self.http.get("/metrics") as response:
            assert response.status == 200
            return await response.text()

    async def wait_idle(self) -> None:
        """Every lease released: ``in_flight`` back to 0 everywhere, no admission slot held."""

        async def idle() -> bool:
            workers = await self.workers()
            admission = self.router.handlers.admission
            return (
                all(w["in_flight"] == 0 for w in workers.values())
                and admission.running == 0
                and admission.queued == 0
            )

        await wait_until_async(idle, "every lease and slot released", WAIT_S)


@asynccontextmanager
async def vllm_cluster(
    prefills: Sequence[VllmBehaviour | FakeVllm],
    decodes: Sequence[VllmBehaviour | FakeVllm],
    aggregated: Sequence[VllmBehaviour | FakeVllm] = (),
    **config: Any,
) -> AsyncIterator[VllmCluster]:
    """The stand-ins started and a router in front of them (``aggregated``: servers listed with
    ``--aggregated``, after the decodes); ``config`` goes to its `RouterConfig` (a test that
    fails mid-request should not wait out the default drain)."""
    config.setdefault("shutdown_timeout_s", 2.0)
    config.setdefault("admin_token", ADMIN_TOKEN)
    started: list[FakeVllm] = []

    async def start(entry: VllmBehaviour | FakeVllm) -> FakeVllm:
        fake = entry if isinstance(entry, FakeVllm) else FakeVllm(entry)
        started.append(await fake.start())
        return fake

    try:
        p = [await start(entry) for entry in prefills]
        d = [await start(entry) for entry in decodes]
        a = [await start(entry) for entry in aggregated]
        router_config = RouterConfig(
            prefill=tuple(f.address for f in p),
            decode=tuple(f.address for f in d),
            aggregated=tuple(f.address for f in a),
            engine="vllm",
            model_name="tiny",
            **config,
        )
        async with (
            RouterServer(router_config) as router,
            aiohttp.ClientSession(base_url=router.url) as http,
        ):
            yield VllmCluster(router, http, p, d, a)
    finally:
        for fake in started:
            await fake.stop()
