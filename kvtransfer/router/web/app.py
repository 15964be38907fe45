"""The router's HTTP app: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` in front of
a fleet of prefill and decode daemons (`fleet.fleet.Fleet`), plus its admin API (``/workers``,
`admin_api`) and its fleet page (``/dashboard``, `fleet_page`).

Life cycle of a request:

1. HTTP in: ``POST /v1/completions`` or ``/v1/chat/completions`` arrives; the clock for
   ``ttft_s``, the latency metric and the deadline (``request_timeout_s``) starts, and the
   request gets one id, ``cmpl-<hex>`` (``chatcmpl-<hex>``), in the answer (also as the
   ``x-request-id`` header) and on every log line.
2. Validate: a body over ``max_request_bytes`` is answered 413 naming the limit; one that is not
   UTF-8 JSON, nests deeper than 64 levels or holds a lone surrogate is 400 naming the problem
   (`openai.requests.parse_json_body`); the JSON becomes a `CompletionRequest` or a
   `ChatCompletionRequest`, a malformed one (or one asking for what the router cannot honour:
   tools, images, penalties) is answered 400 naming the field, an unknown model 404. Nothing
   reaches a daemon. Every error, 404 and 405 for unknown paths included, is OpenAI's error
   shape ``{"error": {"message", "type", "param", "code"}}``.
3. Admit (`admission.Admission`): at most ``max_concurrent_requests`` run at once; the next
   ``max_queued_requests`` wait for a slot in arrival order (within the deadline: else 503);
   beyond them the request is answered 429, both with ``Retry-After``. The slot is held until
   the answer is complete.
4. Choices: the request becomes one `Choice` per prompt and sample (``prompts x n``, index
   ``prompt * n + sample``); sample ``j`` of a seeded request is seeded ``seed + j``, an
   unseeded random one gets a drawn seed, shared by its prefill and decode. A single choice is
   known to the daemons by the request's id, several by ``<id>-<index>``; each gets a
   `routing.policy.RouteContext` (that id, and its prompt's token ids when known).
5. Run: each choice is one prefill and one decode, or a decode alone for a short uncached prompt
   (`daemon_flow.choice.ChoiceRunner`: picking instances by each role's policy, retries on
   another instance, the KV handover, releasing KV nobody decoded); several run concurrently.
   The first choice that fails fails the request; the others are cancelled and their KV
   released.
6. Answer (`answers`): one JSON body (choices in index order, ``usage``, and a ``kvtransfer``
   object: route, token ids, ttft, KV transfer metrics; per choice when there are several), or
   server-sent events: each choice's pieces as they come (its first token as soon as its prefill
   returned), its last chunk with the finish reason and its ``kvtransfer`` object, with
   ``stream_options.include_usage`` a last chunk with ``usage`` and no choices, then
   ``data: [DONE]``.
7. Errors: a daemon failure becomes an `UpstreamError` whose status is answered as an OpenAI
   error body naming the daemon (role and address); see `daemon_flow.upstream` for the table. No
   instance of a role to pick is 503 with ``Retry-After``. Once SSE bytes are out, an error is
   sent as ``data: {"error": ...}`` then ``data: [DONE]``. Every gRPC call carries the remaining
   deadline. A client that disconnects cancels the handler (the runner is built with
   ``handler_cancellation``), which cancels the gRPC calls: the daemons abort the requests and
   free their blocks, and KV a prefill already handed over is released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.choice import ChoiceRunner
from kvtransfer.router.daemon_flow.exchange import Exchange
from kvtransfer.router.daemon_flow.upstream import Upstream
from kvtransfer.router.errors import ClientGone, UpstreamError
from kvtransfer.router.fleet.dns import Resolver, resolve_host
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.metrics import CLIENT_CLOSED, RouterMetrics
from kvtransfer.router.names import AGGREGATED, ROLES, WORKER_ROLES
from kvtransfer.router.openai.requests import (
    Choice,
    InvalidRequest,
    SamplingRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from kvtransfer.router.openai.responses import CHAT, COMPLETIONS, ResponseFormat
from kvtransfer.router.routing.policy import PromptTokenizer, RouteContext, token_ids_of
from kvtransfer.router.vllm_flow.request import VllmCall, check_vllm_body
from kvtransfer.router.web.admin_api import AdminApi
from kvtransfer.router.web.admission import Admission, QueueFull, QueueTimeout
from kvtransfer.router.web.answers import Answer, AnswerWriter
from kvtransfer.router.web.backend import Backend
from kvtransfer.router.web.fleet_page import FleetPage
from kvtransfer.router.web.http_errors import (
    error_response,
    openai_errors,
    too_large,
    unknown_model,
    upstream_failure,
)
from kvtransfer.router.web.recent import (
    RECENT_REQUESTS,
    HookFailures,
    RecentRequests,
    answer_failure,
)
from kvtransfer.timeline import BOOK, now_ns, wall_ns

logger = logging.getLogger("kvtransfer.router")

Parser = Callable[[Any], SamplingRequest]


def make_app(
    config: RouterConfig,
    *,
    resolver: Resolver = resolve_host,
    tokenizer: PromptTokenizer | None = None,
) -> web.Application:
    """The aiohttp app; its fleet (gRPC channels, health checks, DNS) starts on startup and
    closes on cleanup.

    Serve it with ``web.AppRunner(app, handler_cancellation=True)`` (as `RouterServer` does)
    so that a client that disconnects cancels the upstream calls. ``resolver`` resolves the
    ``dns:`` names; ``tokenizer`` gives the policies a prompt's token ids (None: the model of
    ``config.tokenizer``, else only a prompt given as token ids is known).
    """
    router = RouterHandlers(config, resolver=resolver, tokenizer=tokenizer)
    # aiohttp's 1 MiB default is too small for long prompts; see kvtransfer.clients.limits.
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[openai_errors])
    app[ROUTER] = router
    app.cleanup_ctx.append(router.backend.open)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.prometheus)
    AdminApi(config.admin_token, lambda: router.fleet).add_routes(app)
    if router.recent is not None:
        page = FleetPage(config, lambda: router.fleet, router.admission, router.recent)
        page.add_routes(app)
    return app


class RouterHandlers:
    """The endpoints, sharing one `Backend` (the fleet and the flow, opened on the app's loop),
    one `AnswerWriter` and one metrics registry."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        resolver: Resolver = resolve_host,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self._tokenizer = tokenizer or _config_tokenizer(config)
        self.backend = Backend(config, self.metrics, resolver)
        # Kept for the fleet page alone: none without it.
        self.recent = RecentRequests(RECENT_REQUESTS) if config.dashboard else None
        self._summary_failures = HookFailures("a request's summary")
        choice_ended = None if self.recent is None else self.recent.choice_ended
        self.answers = AnswerWriter(self.metrics, lambda: self.runner, choice_ended)
        self.admission = Admission(
            config.max_concurrent_requests, config.max_queued_requests, self._admission_changed
        )

    @property
    def releases_in_flight(self) -> int:
        """``ReleaseKV`` calls started and not yet answered."""
        return self.backend.releases_in_flight

    @property
    def runner(self) -> ChoiceRunner:
        return self.backend.runner

    @property
    def upstream(self) -> Upstream:
        return self.backend.upstream

    @property
    def fleet(self) -> Fleet:
        return self.backend.fleet

    def _admission_changed(self, running: int, queued: int) -> None:
        self.metrics.requests_running.set(running)
        self.metrics.requests_queued.set(queued)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model_name, "object": "model", "owned_by": "kvtransfer"}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        """The fleet as the last health checks and calls left it: 200 while a prefill and a
        decode daemon, or an aggregated one, may be picked, else 503; no daemon is called."""
        fleet = self.fleet
        ok = fleet.any_pickable(AGGREGATED) or all(fleet.any_pickable(r) for r in ROLES)
        states = {kind: fleet.states(kind) for kind in WORKER_ROLES}
        aggregated = states[AGGREGATED]
        states["decode"] = {a: s for a, s in states["decode"].items() if a not in aggregated}
        if not aggregated:
            del states[AGGREGATED]
        body = {"status": "ok" if ok else "unavailable"} | states
        return web.json_response(body, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS, parse_completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT, parse_chat_request)

    async def _serve(
        self, request: web.Request, fmt: ResponseFormat, parse: Parser
    ) -> web.StreamResponse:
        started = time.monotonic()
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        log = logging.LoggerAdapter(logger, {"request_id": request_id})
        status = 500
        response: web.StreamResponse | None = None
        complete = self._complete if self.backend.vllm is None else self._complete_on_vllm
        try:
            response = await complete(request, fmt, parse, request_id, started, log)
            status = response.status
            return response
        except ClientGone as gone:
            status = CLIENT_CLOSED
            log.info("client disconnected mid-stream: upstream calls cancelled")
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
            elapsed = time.monotonic() - started
            self.metrics.request_done(status, elapsed)
            self._summarise(request_id, request.path, started, elapsed, status, response)

    def _summarise(
        self,
        request_id: str,
        path: str,
        started: float,
        elapsed: float,
        status: int,
        response: web.StreamResponse | None,
    ) -> None:
        """The request's summary for the fleet page; a failure here is logged, never the
        request's (the answer is written, or its error on its way)."""
        if self.recent is None:
            return
        try:
            failure = answer_failure(response)
            self.recent.finished(
                request_id,
                path,
                round(wall_ns(started) / 1e6, 3),
                self.config.model_name,
                status,
                round(elapsed * 1e3, 3),
                None if failure is None else failure.message,
                stream_failed=failure is not None and failure.mid_stream,
            )
        except Exception:
            self._summary_failures.record()

    async def _complete(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        parse: Parser,
        request_id: str,
        started: float,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> web.StreamResponse:
        try:
            parsed = parse(parse_json_body(await request.read()))
            choices = parsed.choices()
        except web.HTTPRequestEntityTooLarge:
            return too_large(request_id, log, request)
        except InvalidRequest as exc:
            log.info("rejected (400): %s", exc)
            return error_response(request_id, 400, str(exc), param=exc.param)
        if parsed.model is not None and parsed.model != self.config.model_name:
            return unknown_model(self.config.model_name, request_id, log, parsed.model)
        parsed_at = now_ns()
        model = self.config.model_name
        answer = Answer(fmt, request_id, int(time.time()), model, parsed, choices, started)
        deadline = started + self.config.request_timeout_s
        exchanges = [
            Exchange(
                rid,
                choice,
                started,
                deadline,
                _choice_log(log, rid),
                self._route_context(rid, choice),
                traceparent=request.headers.get("traceparent"),
            )
            for choice, rid in zip(choices, _choice_ids(request_id, len(choices)), strict=True)
        ]
        tokenized_at = now_ns()
        for exchange in exchanges:
            BOOK.record(exchange.request_id, "parse", wall_ns(started), parsed_at)
            BOOK.record(exchange.request_id, "tokenize", parsed_at, tokenized_at)
        log.info(
            "received: %d choice(s), max_tokens=%d, stream=%s",
            len(choices),
            choices[0].max_tokens,
            parsed.stream,
        )

        async def run() -> web.StreamResponse:
            admitted_at = now_ns()
            for exchange in exchanges:
                BOOK.record(exchange.request_id, "admit", tokenized_at, admitted_at)
            if parsed.stream:
                return await self.answers.stream(request, answer, exchanges)
            return await self.answers.collect(answer, exchanges)

        try:
            return await self._admitted(request_id, log, deadline, run)
        finally:
            for exchange in exchanges:
                BOOK.take(exchange.request_id)  # what a failed choice left

    async def _complete_on_vllm(
        self,
        request: web.Request,
        fmt: ResponseFormat,
        parse: Parser,
        request_id: str,
        started: float,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> web.StreamResponse:
        """A request on a fleet of vLLM servers (`vllm_flow`): the body goes on as it came,
        checked here only for what the flow needs."""
        proxy = self.backend.vllm
        if proxy is None:
            raise RuntimeError("the router app has stopped")
        try:
            body = check_vllm_body(parse_json_body(await request.read()))
        except web.HTTPRequestEntityTooLarge:
            return too_large(request_id, log, request)
        except InvalidRequest as exc:
            log.info("rejected (400): %s", exc)
            return error_response(request_id, 400, str(exc), param=exc.param)
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            return unknown_model(self.config.model_name, request_id, log, model)
        deadline = started + self.config.request_timeout_s
        route = RouteContext(request_id, self._vllm_token_ids(body, parse))
        call = VllmCall(request, request_id, body, route, started, deadline, log)
        log.info("received for vLLM: stream=%s", body.get("stream") is True)
        return await self._admitted(request_id, log, deadline, lambda: proxy.serve(call))

    def _vllm_token_ids(self, body: dict[str, Any], parse: Parser) -> tuple[int, ...] | None:
        """The prompt's token ids when this router's parser and tokenizer understand the body
        (vLLM may take more than the parser does: then the route knows no tokens)."""
        try:
            prompt = parse(body).choices()[0].prompt
        except (InvalidRequest, IndexError):
            return None
        token_ids = self._tokenizer(prompt)
        return None if token_ids is None else tuple(token_ids)

    async def _admitted(
        self,
        request_id: str,
        log: logging.LoggerAdapter[logging.Logger],
        deadline: float,
        run: Callable[[], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """``run()`` once admitted (`admission.Admission`); its upstream failure, a full queue
        or a wait past ``deadline`` become the answer."""
        try:
            async with self.admission.slot(deadline):
                return await run()
        except UpstreamError as exc:
            return upstream_failure(
                self.metrics, self.config.health_interval_s, request_id, log, exc
            )
        except QueueFull as exc:
            log.info("rejected (429): %s", exc)
            return error_response(
                request_id,
                429,
                str(exc),
                kind="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        except QueueTimeout as exc:
            log.warning("failed (503): %s", exc)
            headers = {"Retry-After": "1"}
            return error_response(request_id, 503, str(exc), kind="upstream_error", headers=headers)

    def _route_context(self, request_id: str, choice: Choice) -> RouteContext:
        token_ids = self._tokenizer(choice.prompt)
        return RouteContext(request_id, None if token_ids is None else tuple(token_ids))


ROUTER = web.AppKey("router", RouterHandlers)


def _choice_ids(request_id: str, count: int) -> list[str]:
    """The ids the daemons know the choices by: the request's own for a single one."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def _choice_log(
    log: logging.LoggerAdapter[logging.Logger], request_id: str
) -> logging.LoggerAdapter[logging.Logger]:
    if log.extra is not None and log.extra.get("request_id") == request_id:
        return log
    return logging.LoggerAdapter(logger, {"request_id": request_id})


def _config_tokenizer(config: RouterConfig) -> PromptTokenizer:
    if config.tokenizer is None:
        return token_ids_of
    from kvtransfer.router.openai.tokens import RouteTokenizer

    return RouteTokenizer(config.tokenizer, config.chat_template).route_tokens
