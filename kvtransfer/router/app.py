"""The router's HTTP app: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` in front of
a fleet of prefill and decode daemons (`fleet.Fleet`), plus its admin API (``/workers``,
`admin_api`).

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
   `policy.RouteContext` (that id, and its prompt's token ids when known).
5. Run: each choice is one prefill and one decode, or a decode alone for a short uncached
   prompt (`choice.ChoiceRunner`: picking instances by each role's policy, retries on another
   instance, the KV handover, releasing KV nobody decoded); several run concurrently. The first
   choice that fails fails the request; the others are cancelled and their KV released.
6. Answer: one JSON body (choices in index order, ``usage``, and a ``kvtransfer`` object: route,
   token ids, ttft, KV transfer metrics; per choice when there are several), or server-sent
   events: each choice's pieces as they come (its first token as soon as its prefill returned),
   its last chunk with the finish reason and its ``kvtransfer`` object, with
   ``stream_options.include_usage`` a last chunk with ``usage`` and no choices, then
   ``data: [DONE]``.
7. Errors: a daemon failure becomes an `UpstreamError` whose status is answered as an OpenAI
   error body naming the daemon (role and address); see `upstream` for the table. No instance
   of a role to pick is 503 with ``Retry-After``. Once SSE bytes are out, an error is sent as
   ``data: {"error": ...}`` then ``data: [DONE]``. Every gRPC call carries the remaining
   deadline. A client that disconnects cancels the handler (the runner is built with
   ``handler_cancellation``), which cancels the gRPC calls: the daemons abort the requests and
   free their blocks, and KV a prefill already handed over is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtransfer.router.admin_api import AdminApi
from kvtransfer.router.admission import Admission, QueueFull, QueueTimeout
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.daemon_flow.choice import ChoiceRunner
from kvtransfer.router.daemon_flow.exchange import Delta, Exchange
from kvtransfer.router.daemon_flow.upstream import Upstream
from kvtransfer.router.errors import ClientGone, NoHealthyDaemon, UpstreamError
from kvtransfer.router.fleet.cache_wiring import CacheIndexWiring
from kvtransfer.router.fleet.dns import DnsTarget, Resolver, resolve_host
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.metrics import CLIENT_CLOSED, RouterMetrics
from kvtransfer.router.names import AGGREGATED, ROLES, VLLM, WORKER_ROLES
from kvtransfer.router.openai.requests import (
    Choice,
    CompletionRequest,
    InvalidRequest,
    SamplingRequest,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from kvtransfer.router.openai.responses import (
    CHAT,
    COMPLETIONS,
    ChoiceOutput,
    ResponseFormat,
    usage,
)
from kvtransfer.router.routing.policy import (
    PromptTokenizer,
    RouteContext,
    create_policy,
    token_ids_of,
)
from kvtransfer.router.tracing import TraceExporter
from kvtransfer.router.vllm_flow.proxy import VllmProxy
from kvtransfer.router.vllm_flow.request import VllmCall, check_vllm_body
from kvtransfer.timeline import BOOK, now_ns, wall_ns

logger = logging.getLogger("kvtransfer.router")

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) would otherwise buffer the stream and defeat it.
    "X-Accel-Buffering": "no",
}
_SSE_DONE = b"data: [DONE]\n\n"

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
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[_openai_errors])
    app[ROUTER] = router
    app.cleanup_ctx.append(router.channels)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.prometheus)
    AdminApi(config.admin_token, lambda: router.fleet).add_routes(app)
    return app


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method) in OpenAI's shape, so that clients
    raise their typed exceptions instead of failing to parse a text body."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        kind = "invalid_request_error" if exc.status < 500 else "internal_error"
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(error_body(message, kind), status=exc.status, headers=headers)


@dataclass(frozen=True)
class _Answer:
    """What the response to one HTTP request is made of, besides its choices' deltas."""

    format: ResponseFormat
    request_id: str
    created: int
    model: str
    request: SamplingRequest
    choices: tuple[Choice, ...]
    started: float

    @property
    def wants_logprobs(self) -> bool:
        return self.choices[0].logprobs is not None

    def echoed(self, choice: Choice) -> str:
        """The prompt text a completion with ``echo`` starts with."""
        request = self.request
        if isinstance(request, CompletionRequest) and request.echo:
            return str(choice.prompt)
        return ""


class RouterHandlers:
    """The endpoints, sharing one `ChoiceRunner` (opened in `channels`) and one metrics
    registry."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        resolver: Resolver = resolve_host,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self._resolver = resolver
        self._tokenizer = tokenizer or _config_tokenizer(config)
        self._index_metrics_registered = False
        self._runner: ChoiceRunner | None = None
        self._vllm: VllmProxy | None = None
        self.admission = Admission(
            config.max_concurrent_requests, config.max_queued_requests, self._admission_changed
        )

    @property
    def releases_in_flight(self) -> int:
        """``ReleaseKV`` calls started and not yet answered."""
        return 0 if self._runner is None else len(self._runner.releases)

    @property
    def runner(self) -> ChoiceRunner:
        if self._runner is None:
            raise RuntimeError("the router app has not started (no gRPC channels yet)")
        return self._runner

    @property
    def upstream(self) -> Upstream:
        upstream = self.runner.upstream
        if upstream is None:
            raise RuntimeError("the router app has stopped (no gRPC channels)")
        return upstream

    @property
    def fleet(self) -> Fleet:
        return self.upstream.fleet

    async def channels(self, app: web.Application) -> AsyncIterator[None]:
        # grpc.aio channels belong to the loop that creates them: open them on the app's loop.
        config = self.config
        policies = {role: create_policy(config.policy_for(role), role, config) for role in ROLES}
        wiring = CacheIndexWiring(policies, config, self.metrics)
        if self._index_metrics_registered is False:
            wiring.register_metrics(self.metrics.registry)
            self._index_metrics_registered = True
        fleet = Fleet(
            policies,
            credentials=config.channel_credentials(),
            options=config.channel_options(),
            health_interval_s=config.health_interval_s,
            health_timeout_s=config.health_timeout_s,
            breaker_failures=config.breaker_failures,
            breaker_cooldown_s=config.breaker_cooldown_s,
            daemon_admin_token=config.daemon_admin_token,
            dns_targets=[
                DnsTarget(role, name, port)
                for role in WORKER_ROLES
                for name, port in config.dns_names(role)
            ],
            dns_interval_s=config.dns_interval_s,
            resolver=self._resolver,
            listener=wiring,
            engine=config.engine,
        )
        self.metrics.watch_instances(fleet.instances)
        try:
            for role in WORKER_ROLES:
                for address in config.addresses(role):
                    fleet.add(role, address)
            await fleet.start()
        except BaseException:
            await fleet.close()
            await wiring.close()
            raise
        upstream = Upstream(fleet)
        traces = None
        if config.otlp_traces_endpoint:
            traces = TraceExporter(config.otlp_traces_endpoint)
        runner = self._runner = ChoiceRunner(config, self.metrics, upstream, traces)
        if config.engine == VLLM:
            self._vllm = VllmProxy(config, self.metrics, fleet)
        try:
            yield
        finally:
            self._vllm = None
            # Handlers are done by now; the releases they started each have a deadline
            # (release_timeout_s), so waiting for them is bounded.
            await runner.close()
            self._runner = None
            if traces is not None:
                await asyncio.to_thread(traces.shutdown)
            await fleet.close()
            await wiring.close()

    def _admission_changed(self, running: int, queued: int) -> None:
        self.metrics.requests_running.set(running)
        self.metrics.requests_queued.set(queued)

    # ------------------------------------------------------------------ small endpoints

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

    # ------------------------------------------------------------------ completions

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
        complete = self._complete if self._vllm is None else self._complete_on_vllm
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
            self.metrics.request_done(status, time.monotonic() - started)

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
            return self._too_large(request_id, log, request)
        except InvalidRequest as exc:
            log.info("rejected (400): %s", exc)
            return _error(request_id, 400, str(exc), param=exc.param)
        if parsed.model is not None and parsed.model != self.config.model_name:
            return self._unknown_model(request_id, log, parsed.model)
        parsed_at = now_ns()
        model = self.config.model_name
        answer = _Answer(fmt, request_id, int(time.time()), model, parsed, choices, started)
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
                return await self._stream(request, answer, exchanges)
            return await self._collect(answer, exchanges)

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
        proxy = self._vllm
        if proxy is None:
            raise RuntimeError("the router app has stopped")
        try:
            body = check_vllm_body(parse_json_body(await request.read()))
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(request_id, log, request)
        except InvalidRequest as exc:
            log.info("rejected (400): %s", exc)
            return _error(request_id, 400, str(exc), param=exc.param)
        model = body.get("model")
        if model is not None and model != self.config.model_name:
            return self._unknown_model(request_id, log, model)
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
            return self._upstream_failure(request_id, log, exc)
        except QueueFull as exc:
            log.info("rejected (429): %s", exc)
            return _error(
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
            return _error(request_id, 503, str(exc), kind="upstream_error", headers=headers)

    def _unknown_model(
        self, request_id: str, log: logging.LoggerAdapter[logging.Logger], model: object
    ) -> web.Response:
        log.info("rejected (404): unknown model %r", model)
        message = f"model {model!r} does not exist (this router serves "
        message += f"{self.config.model_name!r})"
        return _error(request_id, 404, message, param="model", code="model_not_found")

    def _too_large(
        self, request_id: str, log: logging.LoggerAdapter[logging.Logger], request: web.Request
    ) -> web.Response:
        message = (
            f"the request body is larger than {request.client_max_size} bytes, "
            "this router's limit (--max-request-bytes)"
        )
        log.info("rejected (413): %s", message)
        return _error(request_id, 413, message, code="request_too_large")

    def _route_context(self, request_id: str, choice: Choice) -> RouteContext:
        token_ids = self._tokenizer(choice.prompt)
        return RouteContext(request_id, None if token_ids is None else tuple(token_ids))

    async def _deltas(self, answer: _Answer, exchanges: Sequence[Exchange]) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come; the first failure ends them all (raised)."""
        first_token = True
        async with aclosing(_merged(self.runner, exchanges)) as deltas:
            async for delta in deltas:
                if first_token and delta.token_ids:
                    first_token = False
                    self.metrics.first_token(time.monotonic() - answer.started)
                yield delta

    async def _collect(self, answer: _Answer, exchanges: Sequence[Exchange]) -> web.Response:
        outputs = [ChoiceOutput(c.index, [answer.echoed(c)]) for c in answer.choices]
        tokens = _TokenCount(answer.choices)
        async with aclosing(self._deltas(answer, exchanges)) as deltas:
            async for delta in deltas:
                tokens.add(delta)
                output = outputs[delta.index]
                output.texts.append(delta.text)
                output.logprobs.extend(delta.logprobs)
                if delta.finish_reason is not None:
                    output.finish_reason = delta.finish_reason
                    output.kvtransfer = delta.info
        fmt = answer.format
        # One choice keeps its kvtransfer object at the top level, where it always was.
        single = outputs[0].kvtransfer if len(outputs) == 1 else None
        if single is not None:
            outputs[0].kvtransfer = None
        body = fmt.body(
            answer.request_id,
            answer.created,
            answer.model,
            [fmt.choice(output, answer.wants_logprobs) for output in outputs],
            usage=tokens.usage(),
            kvtransfer=single,
        )
        return web.json_response(body, headers={"x-request-id": answer.request_id})

    async def _stream(
        self, request: web.Request, answer: _Answer, exchanges: Sequence[Exchange]
    ) -> web.StreamResponse:
        sse = _SseWriter(request, answer.request_id)
        try:
            await self._stream_into(sse, answer, exchanges)
        except ConnectionResetError:
            if sse.response is None:
                raise
            raise ClientGone(sse.response) from None
        if sse.response is None:  # _stream_into always writes: narrows the type
            raise RuntimeError("unreachable: a stream that wrote nothing")
        return sse.response

    async def _stream_into(
        self, sse: _SseWriter, answer: _Answer, exchanges: Sequence[Exchange]
    ) -> None:
        # The response opens at the first byte to send (`_SseWriter`): an error before that
        # is still a plain HTTP error with its status; after it, an SSE error event.
        fmt = answer.format
        tokens = _TokenCount(answer.choices)
        offsets = [0] * len(answer.choices)  # text sent so far per choice (logprobs offsets)
        opened: set[int] = set()  # choices whose first chunk went out
        include_usage = answer.request.include_usage
        try:
            async with aclosing(self._deltas(answer, exchanges)) as deltas:
                async for delta in deltas:
                    arrived = now_ns()
                    tokens.add(delta)
                    first = delta.index not in opened
                    opened.add(delta.index)
                    text = (
                        answer.echoed(answer.choices[delta.index]) if first else ""
                    ) + delta.text
                    if not (
                        text or delta.logprobs or delta.finish_reason or (first and fmt is CHAT)
                    ):
                        continue
                    choice = fmt.chunk_choice(
                        delta.index,
                        text,
                        delta.finish_reason,
                        delta.logprobs if answer.wants_logprobs else None,
                        first=first,
                        text_offset=offsets[delta.index],
                    )
                    offsets[delta.index] += len(text)
                    chunk = fmt.chunk(
                        answer.request_id,
                        answer.created,
                        answer.model,
                        [choice],
                        kvtransfer=delta.info,
                    )
                    if include_usage:
                        chunk["usage"] = None
                    await sse.send(chunk)
                    if first and delta.token_ids:
                        rid = exchanges[delta.index].request_id
                        BOOK.record(rid, "first_token_out", arrived, now_ns())
        except UpstreamError as exc:
            if sse.response is None:
                raise
            self._count_failure(answer.request_id, exc)
            await sse.send(error_body(str(exc), _error_kind(exc.status)))
            await sse.done()
            return
        if include_usage:
            last = fmt.chunk(
                answer.request_id, answer.created, answer.model, [], usage=tokens.usage()
            )
            await sse.send(last)
        await sse.done()

    # ------------------------------------------------------------------ helpers

    def _upstream_failure(
        self, request_id: str, log: logging.LoggerAdapter[logging.Logger], exc: UpstreamError
    ) -> web.Response:
        self._count_failure(request_id, exc)
        code, headers = None, None
        if isinstance(exc, NoHealthyDaemon):
            # A health check or a DNS resolution may change that: try again after one.
            code = exc.reason
            headers = {"Retry-After": str(max(1, math.ceil(self.config.health_interval_s)))}
        kind = _error_kind(exc.status)
        return _error(request_id, exc.status, str(exc), kind=kind, code=code, headers=headers)

    def _count_failure(self, request_id: str, exc: UpstreamError) -> None:
        logger.warning("failed (%d): %s", exc.status, exc, extra={"request_id": request_id})
        self.metrics.upstream_error(exc.role, exc.reason)


ROUTER = web.AppKey("router", RouterHandlers)


class _TokenCount:
    """``usage``: completion tokens of every choice, prompt tokens once per prompt."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self._choices = choices
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None and self._choices[delta.index].sample == 0:
            self.prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += delta.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def _choice_ids(request_id: str, count: int) -> list[str]:
    """The ids the daemons know the choices by: the request's own for a single one."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def _choice_log(
    log: logging.LoggerAdapter[logging.Logger], request_id: str
) -> logging.LoggerAdapter[logging.Logger]:
    if log.extra is not None and log.extra.get("request_id") == request_id:
        return log
    return logging.LoggerAdapter(logger, {"request_id": request_id})


async def _merged(runner: ChoiceRunner, exchanges: Sequence[Exchange]) -> AsyncIterator[Delta]:
    """The deltas of every choice, interleaved as they come. A single choice runs in the
    caller's task (cancelling the handler cancels its calls directly); several run in tasks of
    their own, all cancelled when the first one fails or the consumer stops reading."""
    if len(exchanges) == 1:
        async with aclosing(runner.run(exchanges[0])) as deltas:
            async for delta in deltas:
                yield delta
        return
    queue: asyncio.Queue[Delta | Exception | None] = asyncio.Queue()

    async def pump(exchange: Exchange) -> None:
        try:
            async with aclosing(runner.run(exchange)) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as exc:  # the request fails with it (an UpstreamError, or a bug)
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(exchange)) for exchange in exchanges]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = error_body(message, kind, param, code)
    headers = {"x-request-id": request_id, **(headers or {})}
    return web.json_response(body, status=status, headers=headers)


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


def _config_tokenizer(config: RouterConfig) -> PromptTokenizer:
    if config.tokenizer is None:
        return token_ids_of
    from kvtransfer.router.openai.tokens import RouteTokenizer

    return RouteTokenizer(config.tokenizer, config.chat_template).route_tokens
