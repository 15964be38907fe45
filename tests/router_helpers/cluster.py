"""A router in front of fake daemons (`fakes.FakeDaemon`), with an HTTP client, for tests.

``async with cluster(prefills=[...], decodes=[...], **router_config) as c`` starts fake daemons
(default behaviours: a good prefill / decode) and a `RouterServer`; ``run(scenario)`` runs a
scenario under a safety-net timeout. Health checks run in the background, so their effects are
awaited (`wait_for_health`, `wait_for_metric`), never timed.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from waiting import wait_until_async

from kvtransfer.router import RouterConfig, RouterServer
from kvtransfer.router.fleet.dns import Resolver, resolve_host
from kvtransfer.router.routing.policy import PromptTokenizer, token_ids_of
from router_helpers.fakes import Behaviour, FakeDaemon

# A safety net so a bug shows as a failure instead of a stuck run; no test relies on timing.
SCENARIO_TIMEOUT_S = 30.0
# Below the safety net, so a wait that fails names what it waited for.
WAIT_S = 20.0
# The admin token of routers whose config turns the admin API on (admin_token=ADMIN_TOKEN).
ADMIN_TOKEN = "r0uter-admin"


@dataclass
class Cluster:
    router: RouterServer
    http: aiohttp.ClientSession
    prefills: list[FakeDaemon]
    decodes: list[FakeDaemon]

    @property
    def prefill(self) -> FakeDaemon:
        return self.prefills[0]

    @property
    def decode(self) -> FakeDaemon:
        return self.decodes[0]

    async def post(self, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.http.post("/v1/completions", data=data) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except json.JSONDecodeError:
                return response.status, text

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(path) as response:
            text = await response.text()
            return response.status, (json.loads(text) if path != "/metrics" else text)

    async def admin(
        self, method: str, path: str, token: str | None = ADMIN_TOKEN, body: Any = None
    ) -> tuple[int, Any]:
        """An admin API call with ``token`` as its bearer token (None: no header)."""
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        data = None if body is None else json.dumps(body).encode()
        async with self.http.request(method, path, data=data, headers=headers) as response:
            return response.status, await response.json()

    async def workers(self) -> dict[str, dict[str, Any]]:
        """``GET /workers`` as address -> worker."""
        status, body = await self.admin("GET", "/workers")
        assert status == 200, body
        return {w["address"]: w for w in body["workers"]}


@asynccontextmanager
async def cluster(
    prefills: Sequence[Behaviour | None] = (None,),
    decodes: Sequence[Behaviour | None] = (None,),
    extra_prefill: Sequence[str] = (),
    extra_decode: Sequence[str] = (),
    resolver: Resolver = resolve_host,
    tokenizer: PromptTokenizer = token_ids_of,
    **config: Any,
) -> AsyncIterator[Cluster]:
    """Fake daemons (default behaviour: a good prefill / decode) and a router in front of them;
    ``extra_*`` are entries added to the router's lists (e.g. where nothing listens, or
    ``dns:NAME:PORT``); ``resolver`` and ``tokenizer`` go to the `RouterServer`."""
    # A test that fails with a request in flight should not wait out the default 60 s drain.
    config.setdefault("shutdown_timeout_s", 2.0)
    p = [await FakeDaemon("prefill", b).start() for b in prefills]
    d = [await FakeDaemon("decode", b).start() for b in decodes]
    try:
        router_config = RouterConfig(
            prefill=(*(f.address for f in p), *extra_prefill),
            decode=(*(f.address for f in d), *extra_decode),
            **config,
        )
        async with (
            RouterServer(router_config, resolver=resolver, tokenizer=tokenizer) as router,
            aiohttp.ClientSession(base_url=router.url) as http,
        ):
            yield Cluster(router, http, p, d)
    finally:
        for fake in (*p, *d):
            await fake.stop()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S))


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sse_events(raw: str) -> list[str]:
    """The ``data:`` payloads of an event stream, checking the framing on the way."""
    assert raw.endswith("\n\n"), raw
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), raw
    return [e.removeprefix("data: ") for e in events]


async def post_stream(c: Cluster, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, str]:
    async with c.http.post("/v1/completions", json={**body, "stream": True}) as response:
        return response, await response.text()


async def wait_for_health(
    c: Cluster, status: str, role: str | None = None, address: str | None = None, state: str = ""
) -> dict[str, Any]:
    """Polls /health until its status is ``status`` (and ``role``'s ``address`` is ``state``):
    health checks run in the background, so their effect is awaited, not timed."""

    async def healthy() -> dict[str, Any] | None:
        _, body = await c.get("/health")
        if body["status"] == status and (role is None or body[role].get(address) == state):
            return body
        return None

    what = f"/health {status!r}" + ("" if role is None else f" with {role} {address} {state}")
    return await wait_until_async(healthy, what, WAIT_S)


async def wait_for_metric(c: Cluster, needle: str) -> str:
    # The handler records its status as it unwinds, just after the daemon saw the cancel.

    async def recorded() -> str | None:
        _, text = await c.get("/metrics")
        return text if needle in text else None

    return await wait_until_async(recorded, f"/metrics holding {needle!r}", WAIT_S)


async def raw_completion(
    c: Cluster, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """POST ``body`` to /v1/completions over a bare socket, so the test can hang up mid-way."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", c.router.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return reader, writer
