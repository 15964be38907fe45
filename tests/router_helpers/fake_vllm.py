"""A stand-in for a vLLM OpenAI server, to test the router's vLLM flow alone
(`kvtransfer.router.vllm_flow`): it records every request (path, body, ``X-Request-Id``) and
answers as its `VllmBehaviour` says. The real thing behind the router is checked in the vLLM
stage (vllm_stage/check_pd.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "engine-7",
    "remote_block_ids": [3, 1, 4],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
}
DECODE_JSON = {"id": "cmpl-x", "object": "text_completion", "choices": [{"text": " world"}]}
SSE_CHUNKS = [
    b'data: {"choices": [{"text": " wor"}]}\n\n',
    b'data: {"choices": [{"text": "ld"}]}\n\n',
]
SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    request_id: str | None
    authorization: str | None = None


Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


async def prefill_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"choices": [{"text": " w"}], "kv_transfer_params": PARAMS})


def prefill_reporting(cached_tokens: int) -> Handler:
    """A prefill whose params carry vLLM's ``remote_prefill_cached_tokens`` (its prefix-cache
    hit on the prompt)."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        params = {**PARAMS, "remote_prefill_cached_tokens": cached_tokens}
        return web.json_response({"choices": [{"text": " w"}], "kv_transfer_params": params})

    return handler


def decode_reporting(cached_tokens: int) -> Handler:
    """A decode whose answer has ``usage.prompt_tokens_details.cached_tokens``."""
    return decode_answering_usage({"prompt_tokens_details": {"cached_tokens": cached_tokens}})


def decode_answering_usage(usage: object) -> Handler:
    """A decode (JSON or streamed, as asked) whose answer carries ``usage``; streamed, as vLLM
    does with ``stream_options.include_usage``: a usage chunk, then ``[DONE]``."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body.get("stream") is not True:
            return web.json_response({**DECODE_JSON, "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage_chunk = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        for chunk in (*SSE_CHUNKS, usage_chunk, SSE_DONE):
            await response.write(chunk)
        await response.write_eof()
        return response

    return handler


async def prefill_without_params(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    return web.json_response({"choices": [{"text": ".", "finish_reason": "stop"}]})


async def decode_ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if body.get("stream") is not True:
        return web.json_response(DECODE_JSON)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in (*SSE_CHUNKS, SSE_DONE):
        await response.write(chunk)
    await response.write_eof()
    return response


def prefill_or_whole(whole: Handler) -> Handler:
    """A vLLM prefill as it is (``kv_producer``): a request asking for remote decode gets one
    token and its params; one without ``kv_transfer_params`` runs whole, as on any server
    (answered by ``whole``)."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if "kv_transfer_params" in body:
            return await prefill_ok(request, body)
        return await whole(request, body)

    return handler


def decode_paced(gap_s: float) -> Handler:
    """`decode_ok`'s events ``gap_s`` apart, as a decode stepping at that pace sends them."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body.get("stream") is not True:
            return web.json_response(DECODE_JSON)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in SSE_CHUNKS:
            await response.write(chunk)
            await asyncio.sleep(gap_s)
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    return handler


def decode_cut(cut: asyncio.Event) -> Handler:
    """One event, then, once ``cut`` is set, the connection dies (a decode that crashed
    mid-stream); the test sets it when the event reached its client, so the router had
    passed bytes on before the cut."""

    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE_CHUNKS[0])
        await cut.wait()
        transport = request.transport
        if transport is not None:
            transport.abort()
        return response

    return handler


async def decode_truncated(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Its events, then a clean close without ``data: [DONE]`` (a server that gave up)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in SSE_CHUNKS:
        await response.write(chunk)
    await response.write_eof()
    return response


def status(code: int, message: str) -> Handler:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        error = {"error": {"message": message, "type": "BadRequestError", "code": code}}
        return web.json_response(error, status=code)

    return handler


@dataclass
class VllmBehaviour:
    completions: Handler = decode_ok
    health_status: int = 200
    metrics: str = ""


@dataclass
class FakeVllm:
    behaviour: VllmBehaviour
    seen: list[Seen] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeVllm:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        if server is None or not server.sockets:  # pragma: no cover - aiohttp always binds
            raise RuntimeError("the fake vLLM server did not bind")
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        headers = request.headers
        seen = Seen(request.path, body, headers.get("X-Request-Id"), headers.get("Authorization"))
        self.seen.append(seen)
        return await self.behaviour.completions(request, body)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behaviour.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.behaviour.metrics, content_type="text/plain")


def vllm_metrics(running: float, waiting: float, kv_usage: float) -> str:
    """vLLM's gauges as its /metrics writes them (two data-parallel engines, the load split)."""
    lines = []
    for name, value in (
        ("vllm:num_requests_running", running),
        ("vllm:num_requests_waiting", waiting),
        ("vllm:kv_cache_usage_perc", kv_usage),
    ):
        lines.append(f"# HELP {name} a vLLM gauge")
        lines.append(f"# TYPE {name} gauge")
        for engine in ("0", "1"):
            share = value if name.endswith("perc") else value / 2
            lines.append(f'{name}{{engine="{engine}",model_name="tiny"}} {share}')
    return "\n".join(lines) + "\n"


def vllm_itl_histogram(sum_s: float, count: int) -> str:
    """vLLM's ``vllm:inter_token_latency_seconds`` histogram as its /metrics writes it (every
    gap in the one bucket that holds them all)."""
    name = "vllm:inter_token_latency_seconds"
    labels = 'engine="0",model_name="tiny"'
    return (
        "\n".join(
            (
                f"# HELP {name} Histogram of inter-token latency in seconds.",
                f"# TYPE {name} histogram",
                f'{name}_bucket{{{labels},le="+Inf"}} {count}',
                f"{name}_count{{{labels}}} {count}",
                f"{name}_sum{{{labels}}} {sum_s}",
            )
        )
        + "\n"
    )
