"""The router's HTTP app: OpenAI ``/v1/completions`` in front of prefill and decode daemons.

Life cycle of a request:

1. HTTP in: ``POST /v1/completions`` arrives; the clock for ``ttft_s``, the latency metric and
   the deadline (``request_timeout_s``) starts, and the request gets one id, ``cmpl-<hex>``,
   used on both daemons, in the answer (also as the ``x-request-id`` header) and on every log
   line.
2. Validate: a body over ``max_request_bytes`` is answered 413 naming the limit; one that is not
   UTF-8 JSON, nests deeper than 64 levels or holds a lone surrogate is 400 naming the problem
   (`openai_api.parse_json_body`); the JSON becomes a `CompletionRequest`, a malformed one is
   answered 400 naming the field, an unknown model 404. Nothing reaches a daemon.
3. Pick daemons, healthy ones only (`upstream.DaemonPool`: health-checked every
   ``health_interval_s``, a daemon whose call fails at the transport level is ejected at once).
   With no healthy decode daemon the answer is 503 naming each decode daemon's state, before
   any prefill: KV prefilled for nobody would only be held until its lease ran out. Then the
   next healthy prefill daemon in turn; the next healthy decode daemon in turn once the prefill
   has succeeded (two separate round-robin counters).
4. Prefill: ``Generate`` with the prompt, ``max_tokens=1``, every sampling option (stop strings
   included) and, unless the client asked for one token, ``kv_transfer_params=
   {"do_remote_decode": true, "kv_stream": true}``. A prefill that streams announces its params
   in a message before it computes the prompt's last part: the decode daemon (picked before
   the prefill) is called at once with them and ``await_generated_tokens``, and pulls each
   layer as it is computed (`_EarlyDecode`). Its final message holds the request's first token.
5. First token: it is the client's first token (SSE: sent at once, before any decode call).
   When it ended the request (``max_tokens`` 1, a stop string, the end of sequence) the answer
   ends here; KV held anyway is released (step 9). A final ``finish_reason`` "error", or a
   "length" finish without ``kv_transfer_params_json``, is a 502.
6. Decode: called early, it gets the first token through ``Continue``; otherwise ``Generate`` on
   the decode daemon now, with the same id, the original prompt, every sampling option, the
   prefill's params verbatim and its first token as ``generated_token_ids``. It holds the KV
   of every prompt token and continues after that token (no prompt token is computed again);
   its stream holds the tokens after the first. A prefill that fails after announcing its
   params leaves the decode to its load-failure policy (``Continue`` without a token: it
   computes the first token itself if it recomputes).
7. Stream out: one JSON body (plus a ``kvtransfer`` object: route, token ids, ttft, KV transfer
   metrics), or server-sent events, one ``data:`` chunk for the first token and one per decode
   message with text, the last with the finish reason and the ``kvtransfer`` object, then
   ``data: [DONE]``.
8. Errors: a daemon failure becomes an `UpstreamError` whose status is answered as an OpenAI
   error body naming the daemon (role and address); see `upstream` for the table. Once SSE bytes
   are out, an error is sent as ``data: {"error": ...}`` then ``data: [DONE]``. Every gRPC call
   carries the remaining deadline. A client that disconnects cancels the handler (the runner
   is built with ``handler_cancellation``), which cancels the gRPC call: the daemon aborts the
   request and frees its blocks.
9. Release: once the prefill returned its params, a decode that does not finish with "length"
   or "stop" (no healthy decode left, the call failed, an error or abort finish, the client
   went away) makes the router call ``ReleaseKV`` on that prefill daemon with exactly those
   params, so the KV is freed now rather than at the end of its lease. The call runs in a task
   of its own with ``release_timeout_s``: the client's answer never waits for it and the
   handler's cancellation does not reach it; ``kvtransfer_router_kv_releases_total`` counts
   the outcomes. A client that leaves during the prefill gives that call ``PREFILL_GRACE_S``
   to deliver a final message already on its way (then its KV is released the same way);
   a prefill still computing after that is cancelled, and the daemon gives back its KV itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.metrics import CLIENT_CLOSED, RouterMetrics
from kvtransfer.router.openai_api import (
    CompletionRequest,
    InvalidRequest,
    completion_body,
    error_body,
    parse_completion_request,
    parse_json_body,
)
from kvtransfer.router.upstream import (
    CallStream,
    Daemon,
    DaemonPool,
    NoHealthyDaemon,
    PrefillResult,
    Upstream,
    UpstreamError,
)
from kvtransfer.v1 import generation_pb2

logger = logging.getLogger("kvtransfer.router")

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) would otherwise buffer the stream and defeat it.
    "X-Accel-Buffering": "no",
}
_SSE_DONE = b"data: [DONE]\n\n"
# How long a prefill call whose client left may take to deliver a final message already sent.
PREFILL_GRACE_S = 0.5
# Decode outcomes after which the decode engine has pulled, or let go of, the prefill's KV.
_CLEAN_FINISHES = frozenset({"length", "stop"})


def make_app(config: RouterConfig) -> web.Application:
    """The aiohttp app; its gRPC channels open on startup and close on cleanup.

    Serve it with ``web.AppRunner(app, handler_cancellation=True)`` (as `RouterServer` does)
    so that a client that disconnects cancels the upstream calls.
    """
    router = RouterHandlers(config)
    # aiohttp's 1 MiB default is too small for long prompts; see kvtransfer.serve.limits.
    app = web.Application(client_max_size=config.max_request_bytes)
    app[ROUTER] = router
    app.cleanup_ctx.append(router.channels)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.prometheus)
    return app


@dataclass
class _Exchange:
    """One request's state from validation on."""

    request_id: str
    request: CompletionRequest
    started: float
    created: int
    log: logging.LoggerAdapter[logging.Logger]
    route: dict[str, str] = field(default_factory=dict)
    # Set once the decode stream ended with "length" or "stop": its KV load is settled.
    decoded: bool = False


@dataclass
class _Decoded:
    """The decode stream, accumulated."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first_token_at: float | None = None
    second_token_at: float | None = None
    final: generation_pb2.GenerateResponse | None = None
    # The prefill's final message (its metrics are the prefill's phases).
    prefill: generation_pb2.GenerateResponse | None = None

    def seed(self, first: generation_pb2.GenerateResponse) -> None:
        """Start from the prefill's final message: the first token, its text, the prompt size
        (a decode stream then continues it; when the first token ended the request, it is
        also the final message)."""
        self.prefill = first
        self.first_token_at = time.monotonic() if first.token_ids else None
        self.token_ids.extend(first.token_ids)
        self.texts.append(first.text)
        self.num_prompt_tokens = first.num_prompt_tokens

    def absorb(self, reply: generation_pb2.GenerateResponse) -> bool:
        """Adds ``reply``; True when it carried the first token.

        Streams are read to their end rather than left at the final message, so the call ends
        on its own instead of being cancelled; anything after a final message is ignored.
        """
        if self.final is not None:
            return False
        first = bool(reply.token_ids) and self.first_token_at is None
        if first:
            self.first_token_at = time.monotonic()
        elif reply.token_ids and self.second_token_at is None:
            self.second_token_at = time.monotonic()
        self.token_ids.extend(reply.token_ids)
        self.texts.append(reply.text)
        if reply.num_prompt_tokens:
            self.num_prompt_tokens = reply.num_prompt_tokens
        if reply.finished:
            self.final = reply
        return first

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def phases(self) -> dict[str, float]:
        """Where the time went, in seconds: each daemon's own measurements, joined, plus the
        first-to-second token gap this router saw (absent phases are left out)."""
        phases: dict[str, float] = {}
        if self.prefill is not None and self.prefill.HasField("metrics"):
            phases["prefill_queue_s"] = self.prefill.metrics.queue_s
            phases["prefill_compute_s"] = self.prefill.metrics.compute_s
        final = self.final
        if final is not None and final is not self.prefill and final.HasField("metrics"):
            phases["decode_queue_s"] = final.metrics.queue_s
            phases["kv_transfer_s"] = final.metrics.kv_transfer_s
            phases["kv_overlapped_s"] = final.metrics.kv_overlapped_s
            phases["decode_first_step_s"] = final.metrics.compute_s
        if self.first_token_at is not None and self.second_token_at is not None:
            phases["second_token_s"] = self.second_token_at - self.first_token_at
        return phases

    @property
    def clean(self) -> bool:
        return self.final is not None and self.final.finish_reason in _CLEAN_FINISHES

    def failure(self, address: str) -> UpstreamError | None:
        if self.final is None:
            message = "the stream ended without a final message"
            return UpstreamError(502, message, "decode", address, "incomplete_stream")
        if self.final.finish_reason == "error":
            message = self.final.error or "finished with an error"
            return UpstreamError(502, message, "decode", address, "finish_error")
        return None


class RouterHandlers:
    """The endpoints, sharing one `Upstream` (opened in `channels`) and one metrics registry."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self._upstream: Upstream | None = None
        # ReleaseKV calls in flight: they outlive their handlers, not the channels.
        self._releases: set[asyncio.Task[None]] = set()

    @property
    def releases_in_flight(self) -> int:
        """``ReleaseKV`` calls started and not yet answered."""
        return len(self._releases)

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("the router app has not started (no gRPC channels yet)")
        return self._upstream

    async def channels(self, app: web.Application) -> AsyncIterator[None]:
        # grpc.aio channels belong to the loop that creates them: open them on the app's loop.
        config = self.config
        credentials = config.channel_credentials()
        pools = [
            DaemonPool(
                role,
                addresses,
                credentials,
                options=config.channel_options(),
                on_health=self._health_changed,
            )
            for role, addresses in (("prefill", config.prefill), ("decode", config.decode))
        ]
        upstream = Upstream(*pools)
        try:
            await upstream.start(config.health_interval_s, config.health_timeout_s)
        except BaseException:
            await upstream.close()
            raise
        self._upstream = upstream
        try:
            yield
        finally:
            # Handlers are done by now; the releases they started each have a deadline
            # (release_timeout_s), so waiting for them is bounded.
            await asyncio.gather(*self._releases, return_exceptions=True)
            self._upstream = None
            await upstream.close()

    def _health_changed(self, daemon: Daemon, healthy: bool, state: str, first: bool) -> None:
        self.metrics.daemon_health(daemon.role, daemon.address, healthy, state, first)

    # ------------------------------------------------------------------ small endpoints

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "owned_by": "kvtransfer"}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        """The pool as the last health checks and calls left it: 200 while at least one
        prefill and one decode daemon may be picked, else 503; no daemon is called."""
        prefill, decode = self.upstream.prefill, self.upstream.decode
        ok = prefill.any_healthy() and decode.any_healthy()
        body = {
            "status": "ok" if ok else "unavailable",
            "prefill": prefill.states(),
            "decode": decode.states(),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        log = logging.LoggerAdapter(logger, {"request_id": request_id})
        status = 500
        try:
            response = await self._complete(request, request_id, started, log)
            status = response.status
            return response
        except _ClientGone as gone:
            status = CLIENT_CLOSED
            log.info("client disconnected mid-stream: upstream call cancelled")
            # Already prepared: aiohttp's write_eof meets the closed connection and lets go.
            return gone.response
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects (handler_cancellation),
            # or when a stop outlasts shutdown_timeout_s; unwinding cancels any gRPC call.
            status = CLIENT_CLOSED
            log.info("cancelled (client disconnected or router stopping)")
            raise
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.metrics.request_done(status, time.monotonic() - started)

    async def _complete(
        self,
        request: web.Request,
        request_id: str,
        started: float,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> web.StreamResponse:
        try:
            parsed = parse_completion_request(parse_json_body(await request.read()))
        except web.HTTPRequestEntityTooLarge:
            message = (
                f"the request body is larger than {request.client_max_size} bytes, "
                "this router's limit (--max-request-bytes)"
            )
            log.info("rejected (413): %s", message)
            return _error(request_id, 413, message, code="request_too_large")
        except InvalidRequest as exc:
            log.info("rejected (400): %s", exc)
            return _error(request_id, 400, str(exc), param=exc.param)
        if parsed.model is not None and parsed.model != self.config.model_name:
            log.info("rejected (404): unknown model %r", parsed.model)
            message = f"model {parsed.model!r} does not exist (this router serves "
            message += f"{self.config.model_name!r})"
            return _error(request_id, 404, message, param="model", code="model_not_found")
        exchange = _Exchange(request_id, parsed, started, int(time.time()), log)
        log.info(
            "received: %s prompt, max_tokens=%d, stream=%s",
            "text" if isinstance(parsed.prompt, str) else f"{len(parsed.prompt)}-token",
            parsed.max_tokens,
            parsed.stream,
        )
        try:
            return await self._route(request, exchange)
        except UpstreamError as exc:
            return self._upstream_failure(exchange, exc)

    async def _route(self, request: web.Request, exchange: _Exchange) -> web.StreamResponse:
        deadline = exchange.started + self.config.request_timeout_s
        upstream = self.upstream
        decode: Daemon | None = None
        if exchange.request.max_tokens > 1:
            # KV prefilled for no decode daemon would only wait out its lease.
            upstream.decode.require_healthy()
            decode = upstream.pick_decode()
        early = _EarlyDecode(upstream, decode, exchange, deadline)
        try:
            streams = decode is not None and self.config.kv_stream
            prefill = await self._prefill(
                upstream, exchange, deadline, early.start if streams else None
            )
        except UpstreamError as exc:
            if decode is None or early.replies is None:
                raise
            # The prefill failed after announcing its KV: the decode, already loading it, goes
            # on under its kv_load_failure_policy and computes the first token itself.
            exchange.log.warning("prefill failed mid-stream (%s); decode goes on alone", exc)
            self.metrics.upstream_error(exc.role, exc.reason)
            exchange.route = {"prefill": exc.address, "decode": decode.address}
            replies = await early.continue_with(None)
            async with aclosing(replies):
                return await self._respond(request, exchange, _Decoded(), replies)
        except BaseException:
            await early.close()
            raise
        exchange.route = {"prefill": prefill.daemon.address}
        decoded = _Decoded()
        decoded.seed(prefill.final)
        if decoded.first_token_at is not None:
            self.metrics.first_token(decoded.first_token_at - exchange.started)
        if not prefill.continues or decode is None:
            # The first token ended the request (max_tokens 1, a stop, the end of sequence).
            await early.close()
            decoded.final = prefill.final
            exchange.decoded = True
            if prefill.kv_transfer_params_json:
                self._release_soon(exchange, prefill, "ended_at_first_token")
            return await self._respond(request, exchange, decoded, None)
        try:
            response = await self._decode(request, exchange, prefill, decoded, decode, early)
        except BaseException as exc:
            self._release_unless_decoded(exchange, prefill, _release_trigger(exc))
            raise
        # An SSE stream that failed after its first byte ends here too, with an error event.
        self._release_unless_decoded(exchange, prefill, "decode_failed")
        return response

    async def _decode(
        self,
        request: web.Request,
        exchange: _Exchange,
        prefill: PrefillResult,
        decoded: _Decoded,
        decode: Daemon,
        early: _EarlyDecode,
    ) -> web.StreamResponse:
        exchange.route["decode"] = decode.address
        exchange.log.info(
            "prefilled on %s (%.1f ms); decoding on %s%s",
            prefill.daemon.address,
            (time.monotonic() - exchange.started) * 1e3,
            decode.address,
            " (called while the prefill computed)" if early.replies is not None else "",
        )
        replies = await early.continue_with(prefill)
        # aclosing: leaving early (error, client gone) closes the stream, cancelling the call.
        async with aclosing(replies):
            return await self._respond(request, exchange, decoded, replies)

    async def _respond(
        self,
        request: web.Request,
        exchange: _Exchange,
        decoded: _Decoded,
        replies: AsyncIterator[generation_pb2.GenerateResponse] | None,
    ) -> web.StreamResponse:
        """The answer: the prefill's first token, then the decode stream (``None`` when the
        first token ended the request)."""
        if exchange.request.stream:
            return await self._stream(request, exchange, decoded, replies)
        return await self._collect(exchange, decoded, replies)

    async def _collect(
        self,
        exchange: _Exchange,
        decoded: _Decoded,
        replies: AsyncIterator[generation_pb2.GenerateResponse] | None,
    ) -> web.Response:
        if replies is not None:
            async for reply in replies:
                self._absorb(exchange, decoded, reply)
        failure = decoded.failure(exchange.route.get("decode", exchange.route["prefill"]))
        if failure is not None:
            raise failure
        exchange.decoded = decoded.clean
        usage = {
            "prompt_tokens": decoded.num_prompt_tokens,
            "completion_tokens": len(decoded.token_ids),
            "total_tokens": decoded.num_prompt_tokens + len(decoded.token_ids),
        }
        body = completion_body(
            exchange.request_id,
            self.config.model_name,
            decoded.text,
            decoded.final.finish_reason if decoded.final is not None else None,
            created=exchange.created,
            usage=usage,
            kvtransfer=_kvtransfer_info(exchange, decoded),
        )
        self._log_done(exchange, decoded)
        return web.json_response(body, headers={"x-request-id": exchange.request_id})

    async def _stream(
        self,
        request: web.Request,
        exchange: _Exchange,
        decoded: _Decoded,
        replies: AsyncIterator[generation_pb2.GenerateResponse] | None,
    ) -> web.StreamResponse:
        sse = _SseWriter(request, exchange.request_id)
        try:
            await self._stream_into(sse, exchange, decoded, replies)
        except ConnectionResetError:
            if sse.response is None:
                raise
            raise _ClientGone(sse.response) from None
        if sse.response is None:  # _stream_into always writes: narrows the type
            raise RuntimeError("unreachable: a stream that wrote nothing")
        return sse.response

    async def _stream_into(
        self,
        sse: _SseWriter,
        exchange: _Exchange,
        decoded: _Decoded,
        replies: AsyncIterator[generation_pb2.GenerateResponse] | None,
    ) -> None:
        # The response opens at the first byte to send (`_SseWriter`): an error before that
        # is still a plain HTTP error with its status; after it, an SSE error event.
        try:
            if replies is not None:
                # The first token goes out now, before the decode daemon answers.
                if decoded.text:
                    await sse.send(self._chunk(exchange, decoded.text, None))
                async for reply in replies:
                    self._absorb(exchange, decoded, reply)
                    if decoded.final is None and reply.text:
                        await sse.send(self._chunk(exchange, reply.text, None))
            failure = decoded.failure(exchange.route.get("decode", exchange.route["prefill"]))
            if failure is not None:
                raise failure
        except UpstreamError as exc:
            if sse.response is None:
                raise
            self._count_failure(exchange, exc)
            await sse.send(error_body(str(exc), _error_kind(exc.status)))
            await sse.done()
            return
        final = decoded.final
        if final is None:  # failure() above rules this out; narrows the type
            raise RuntimeError("unreachable: a decode stream without a final message")
        exchange.decoded = decoded.clean
        info = _kvtransfer_info(exchange, decoded)
        # Ended by its first token, the final chunk carries that token's text.
        text = final.text if replies is not None else decoded.text
        await sse.send(self._chunk(exchange, text, final.finish_reason, info))
        await sse.done()
        self._log_done(exchange, decoded)

    # ------------------------------------------------------------------ releasing KV

    async def _prefill(
        self,
        upstream: Upstream,
        exchange: _Exchange,
        deadline: float,
        on_params: Callable[[str], None] | None = None,
    ) -> PrefillResult:
        """The prefill call, shielded from the client leaving at the very moment it ends.

        If the handler is cancelled, the call gets `PREFILL_GRACE_S` more to deliver a final
        message that may already be on its way (the daemon finished, the RPC completed, only
        this side has not read it yet), and that KV is released; a prefill still computing is
        cancelled, and the daemon then gives its KV back itself.
        """
        call = asyncio.ensure_future(
            upstream.run_prefill(exchange.request_id, exchange.request, deadline, on_params)
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            task = asyncio.get_running_loop().create_task(self._release_late(exchange, call))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)
            raise

    async def _release_late(self, exchange: _Exchange, call: asyncio.Future[PrefillResult]) -> None:
        try:
            prefill = await asyncio.wait_for(call, PREFILL_GRACE_S)
        except (TimeoutError, asyncio.CancelledError, UpstreamError):
            return  # cancelled while computing (the daemon releases), or failed: nothing held
        upstream = self._upstream
        if upstream is not None:
            await self._release(upstream, exchange, prefill, "client_gone")

    def _release_unless_decoded(
        self, exchange: _Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        """Unless the decode stream finished cleanly, give the prefill's KV back now.

        A task of its own: the client's answer never waits for it, and cancelling the handler
        (the client went away) does not cancel it.
        """
        if not exchange.decoded:
            self._release_soon(exchange, prefill, trigger)

    def _release_soon(self, exchange: _Exchange, prefill: PrefillResult, trigger: str) -> None:
        """``ReleaseKV`` in a task of its own (see `_release_unless_decoded`)."""
        upstream = self._upstream
        if upstream is None:  # closed: the lease frees the KV instead
            return
        release = self._release(upstream, exchange, prefill, trigger)
        task = asyncio.get_running_loop().create_task(release)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(
        self, upstream: Upstream, exchange: _Exchange, prefill: PrefillResult, trigger: str
    ) -> None:
        outcome = await upstream.release_kv(
            prefill, exchange.request_id, self.config.release_timeout_s
        )
        self.metrics.kv_release(trigger, outcome)
        log = exchange.log.info if outcome in ("released", "not_held") else exchange.log.warning
        log("KV release on %s (%s): %s", prefill.daemon.address, trigger, outcome)

    # ------------------------------------------------------------------ helpers

    def _absorb(
        self, exchange: _Exchange, decoded: _Decoded, reply: generation_pb2.GenerateResponse
    ) -> None:
        if decoded.absorb(reply) and decoded.first_token_at is not None:
            self.metrics.first_token(decoded.first_token_at - exchange.started)

    def _chunk(
        self,
        exchange: _Exchange,
        text: str,
        finish_reason: str | None,
        info: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return completion_body(
            exchange.request_id,
            self.config.model_name,
            text,
            finish_reason,
            created=exchange.created,
            kvtransfer=info,
        )

    def _upstream_failure(self, exchange: _Exchange, exc: UpstreamError) -> web.Response:
        self._count_failure(exchange, exc)
        code = exc.reason if isinstance(exc, NoHealthyDaemon) else None
        return _error(
            exchange.request_id, exc.status, str(exc), kind=_error_kind(exc.status), code=code
        )

    def _count_failure(self, exchange: _Exchange, exc: UpstreamError) -> None:
        exchange.log.warning("failed (%d): %s", exc.status, exc)
        self.metrics.upstream_error(exc.role, exc.reason)

    def _log_done(self, exchange: _Exchange, decoded: _Decoded) -> None:
        self.metrics.phases(decoded.phases())
        final = decoded.final
        exchange.log.info(
            "done (%s): %d tokens, %d KV blocks received, %.1f ms",
            final.finish_reason if final is not None else "?",
            len(decoded.token_ids),
            final.metrics.kv_blocks_received if final is not None else 0,
            (time.monotonic() - exchange.started) * 1e3,
        )


ROUTER = web.AppKey("router", RouterHandlers)


def _release_trigger(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError | _ClientGone | ConnectionResetError):
        return "client_gone"
    return "decode_failed" if isinstance(exc, UpstreamError) else "error"


def _kvtransfer_info(exchange: _Exchange, decoded: _Decoded) -> dict[str, Any]:
    metrics = decoded.final.metrics if decoded.final is not None else None
    first = decoded.first_token_at
    return {
        "request_id": exchange.request_id,
        **exchange.route,
        "token_ids": list(decoded.token_ids),
        "ttft_s": None if first is None else first - exchange.started,
        "kv_transfer_s": metrics.kv_transfer_s if metrics is not None else 0.0,
        "kv_blocks_received": metrics.kv_blocks_received if metrics is not None else 0,
        "kv_bytes_received": metrics.kv_bytes_received if metrics is not None else 0,
        "num_recomputed_tokens": metrics.num_recomputed_tokens if metrics is not None else 0,
        "phases": decoded.phases(),
    }


def _error_kind(status: int) -> str:
    # OpenAI's type for the client's own mistakes; anything upstream-side is ours to own.
    return "invalid_request_error" if status < 500 else "upstream_error"


def _error(
    request_id: str,
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    body = error_body(message, kind, param, code)
    return web.json_response(body, status=status, headers={"x-request-id": request_id})


class _EarlyDecode:
    """The decode call of one request, started as soon as the prefill announces its params
    (its KV is being computed and streamed), before the first token is known; or, if the
    prefill announced none, started once the prefill returned."""

    def __init__(
        self, upstream: Upstream, decode: Daemon | None, exchange: _Exchange, deadline: float
    ) -> None:
        self._upstream = upstream
        self._decode = decode
        self._exchange = exchange
        self._deadline = deadline
        self.replies: CallStream | None = None

    def start(self, kv_transfer_params_json: str) -> None:
        if self._decode is None or self.replies is not None:
            return
        exchange = self._exchange
        try:
            self.replies = self._upstream.run_decode(
                self._decode,
                exchange.request_id,
                exchange.request,
                kv_transfer_params_json,
                self._deadline,
                None,
            )
        except UpstreamError as exc:  # the deadline ran out: the sequential path reports it
            exchange.log.info("decode not started early: %s", exc)

    async def continue_with(self, prefill: PrefillResult | None) -> CallStream:
        """The decode stream, continuing after the prefill's first token (``None``: the
        prefill failed after the decode was called; it computes its first token itself)."""
        if self._decode is None:
            raise RuntimeError("no decode daemon was picked")
        exchange = self._exchange
        if self.replies is None:
            if prefill is None:
                raise RuntimeError("no decode call was started early")
            return self._upstream.run_decode(
                self._decode,
                exchange.request_id,
                exchange.request,
                prefill.kv_transfer_params_json,
                self._deadline,
                prefill.final.token_ids,
            )
        tokens = () if prefill is None else prefill.final.token_ids
        problem = await self._upstream.continue_decode(
            self._decode, exchange.request_id, tokens, self._deadline
        )
        if problem is not None:
            # The decode stream says what became of the request (e.g. its load failed).
            exchange.log.info("Continue on %s: %s", self._decode.address, problem)
        return self.replies

    async def close(self) -> None:
        """Cancel a decode started early that will not be continued (its daemon aborts it and
        lets go of the producer's KV)."""
        replies, self.replies = self.replies, None
        if replies is not None:
            await replies.aclose()


class _SseWriter:
    """Server-sent events, the response prepared at the first event."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self._request = request
        self._request_id = request_id
        self.response: web.StreamResponse | None = None

    async def send(self, payload: dict[str, Any]) -> None:
        if self.response is None:
            headers = {**_SSE_HEADERS, "x-request-id": self._request_id}
            self.response = web.StreamResponse(status=200, headers=headers)
            await self.response.prepare(self._request)
        await self.response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def done(self) -> None:
        if self.response is None:
            raise RuntimeError("done() before any event")
        await self.response.write(_SSE_DONE)
        await self.response.write_eof()


class _ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response
