"""The router in front of vLLM OpenAI servers (``--engine vllm``): vLLM's own P/D flow, with this
router's choice, health, retries, circuit breakers, admission and metrics.

Every instance is a vLLM OpenAI server (HOST:PORT of ``vllm serve``) running a KV connector
(kvtransfer's UcxConnector, vLLM's NixlConnector, any other that speaks ``kv_transfer_params``):
the prefills as ``kv_producer`` or ``kv_both``, the decodes as ``kv_consumer`` or ``kv_both``.
The client's body goes to vLLM as it came (vLLM checks it and answers its own errors); only what
the flow needs is changed.

Life cycle of a request (after the app's steps 1-3: the id, the body's size, JSON and model
checked, admission):

1. Route: the prompt's token ids when the router knows them (its tokenizer and request parser
   understood the body), for ``cache_aware`` and `disagg.decide` (P/D or one instance alone: by
   ``disagg_min_prompt_tokens``, or with SLO targets by the route predicted to meet them, from
   the prefill calls' durations and the gaps between the decodes' streamed events this router
   timed; while the fleet runs aggregated, `routing.fleet_mode`, whole on the least loaded
   instance). The decision goes into the metrics and the answer's ``x-kvtransfer-route``
   header; with SLO targets the streamed events and the end score it for the fleet's mode.
2. Pick the decode instance first (the decode policy weighs aggregated instances, ``kv_both``
   servers listed with ``--aggregated``, with the others; with no prefill to pick, only they
   can serve): with none, 503 before any prefill holds KV for nobody. An aggregated instance,
   or a request decided to go alone, goes to it alone (step 5 without params). Otherwise a
   prefill instance is picked too. A request decided to run on a prefill alone (with SLO
   targets, while the decodes are at their gap target) picks no decode: step 5 without
   params on a prefill instance, retried on another prefill.
3. Prefill: the client's path and body with ``max_tokens`` 1, ``stream`` false, no
   ``max_completion_tokens``, ``min_tokens``, ``stream_options`` or log-probability options, and
   ``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false}``; header
   ``X-Request-Id`` the router's request id. A 4xx is vLLM refusing the input: the client gets
   it as vLLM wrote it. No answer, or a 5xx: another prefill, after a back-off, up to
   ``max_retries`` times.
4. Its answer's ``kv_transfer_params`` go verbatim into the decode's body. An answer without them
   (its first token ended the request, a stop) leaves the decode to compute the prompt alone.
5. Decode: the client's body with those params, the same ``X-Request-Id``; vLLM's answer is
   passed through as it comes (server-sent events or JSON). No answer or a 5xx before its first
   byte: another decode with the same params (the producer still holds the KV). A stream cut
   after bytes went out, or closed without vLLM's ``data: [DONE]``, ends with an SSE error
   event naming the decode, then ``[DONE]``.
6. KV nobody read: vLLM has no HTTP call that frees a producer's KV, so KV prefilled for a
   decode that failed, or for a client that left, is freed by the producer's own timeout
   (NixlConnector's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, kvtransfer's ``kv_lease_s``).

``n`` (or ``best_of``) above 1, and a batch of prompts, are refused (400): vLLM's answer
carries one ``kv_transfer_params`` (its first sample's, its first prompt's) for all of them. So
are the client's own ``kv_transfer_params``: they would tell a decode where to pull KV from.

What vLLM answers is held to what a vLLM server would answer: an answer that is not 200 or a
4xx (a redirect is not followed), a prefill's answer that is not a JSON object with an object
of ``kv_transfer_params`` (or without them), is the instance's fault (502, retried on another).
Answers are read up to a bound (the prefill's: ``max_request_bytes``, its params go into the
decode's body; the rest: `MAX_ANSWER_BYTES`), never whole into memory past it. The request's
deadline ends a call whenever it comes: 503 before any byte went to the client, else an SSE
error event saying so.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import (
    FAILED_ANSWER,
    ClientGone,
    FailedAnswer,
    NoHealthyDaemon,
    UpstreamError,
)
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.fleet.service import PromptTicket, ServiceStats
from kvtransfer.router.flow_rules import RouteDecider, SloOutcome, retry_pause
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.names import AGGREGATED
from kvtransfer.router.openai.requests import error_body
from kvtransfer.router.routing.disagg import PREFILL_ONLY, RouteDecision
from kvtransfer.router.vllm_flow.answers import (
    ROUTE_HEADER,
    TAIL_BYTES,
    answer_headers,
    closing_bytes,
    ends_done,
    kv_transfer_params,
    passed_through,
    read_bounded,
    read_or_empty,
    reported_cached_tokens,
    route_header,
    streamed_cached_tokens,
)
from kvtransfer.router.vllm_flow.calls import VllmCalls
from kvtransfer.router.vllm_flow.failures import (
    cut_error,
    deadline_error,
    truncated_error,
    vllm_error,
)
from kvtransfer.router.vllm_flow.request import VllmCall

# What vLLM adds to a prefill's kv_transfer_params: the prompt tokens its prefix cache served.
REMOTE_CACHED_KEY = "remote_prefill_cached_tokens"
# Past any model's context: a count above it is a server's garbage (beyond a float's range, it
# would raise in the metric's sum).
_MAX_CACHED_TOKENS = 2**31
# Options of the client's body that have no place in a prefill of one token.
_PREFILL_DROPS = (
    "max_completion_tokens",
    "min_tokens",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
)
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# vLLM's completions default when a body gives no max_tokens.
VLLM_DEFAULT_MAX_TOKENS = 16
# The most of a JSON answer (a decode's, an error) the router holds in memory to pass on: far
# above one sample's answer (100,000 tokens with 20 log-probabilities each fit), far below
# what would hurt the router with many at once.
MAX_ANSWER_BYTES = 64 * 2**20


class VllmProxy:
    """Runs `VllmCall` s on ``fleet`` (whose instances are `VllmEndpoint` s): picks, retries,
    the prefill's params into the decode's body, the decode's answer passed through
    (`calls.VllmCalls` makes the HTTP calls)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, fleet: Fleet) -> None:
        self.config = config
        self.metrics = metrics
        self.fleet = fleet
        self.calls = VllmCalls(config, fleet)
        self.decider = RouteDecider(config, metrics)

    async def serve(self, call: VllmCall) -> web.StreamResponse:
        """The client's answer: the decode's, passed through; raises `UpstreamError` when no
        instance of a role could do its part (the app answers it)."""
        fleet = self.fleet
        can_prefill = fleet.any_pickable("prefill")
        if not can_prefill and not fleet.any_pickable(AGGREGATED):
            fleet.require_pickable("decode")
            fleet.require_pickable("prefill")
        decision = self.decider.decide(fleet, call.route, _max_tokens(call.body))
        call.decision = decision
        self.metrics.route_decision(decision.mode, decision.reason)
        call.outcome = outcome = self.decider.track(call.started)
        answered = failed = False
        try:
            response = await self._serve_routed(call, decision, can_prefill)
            answered = True
            failed = FAILED_ANSWER in response
            return response
        except UpstreamError:
            failed = True
            raise
        finally:
            # Scored from the streamed events `_EventTimer` saw; not when the client left.
            outcome.close(failed=failed, scored=answered)

    async def _serve_routed(
        self, call: VllmCall, decision: RouteDecision, can_prefill: bool
    ) -> web.StreamResponse:
        """The client's answer on the route ``decision`` chose (``can_prefill``: a prefill was
        pickable when it was decided)."""
        fleet = self.fleet
        if decision.on_prefill:
            # The whole request on a prefill: no decode is picked, no KV moves.
            first = fleet.pick("prefill", call.route)
        else:
            first = fleet.pick("decode", call.route, aggregated=None if can_prefill else True)
        tried = [first]
        try:
            params: dict[str, Any] | None = None
            if decision.on_prefill:
                self.metrics.route_mode(PREFILL_ONLY)
            elif first.aggregated:
                self.metrics.route_mode("aggregated")
            elif decision.alone:
                self.metrics.route_mode("decode_only")
            else:
                self.metrics.route_mode("disaggregated")
                # With SLO targets, once its turn at the prefills came (`prefill_order`).
                turn = self.decider.prefill_turn(fleet, decision, call.started, call.deadline)
                async with turn:
                    prefilled = await self._prefill(call)
                if isinstance(prefilled, web.Response):
                    return prefilled
                params = prefilled
            while True:
                try:
                    return await self._decode_once(call, tried[-1], params)
                except UpstreamError as exc:
                    # KV from a prefill goes only to a decode that pulls it.
                    await self._retry(call, tried, exc, None if params is None else False)
        finally:
            for instance in tried:
                fleet.release(instance)

    async def _prefill(self, call: VllmCall) -> dict[str, Any] | web.Response | None:
        """The prefill's ``kv_transfer_params`` (None: it gave none), or vLLM's refusal of the
        input as the client's answer."""
        body = {k: v for k, v in call.body.items() if k not in _PREFILL_DROPS}
        body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        tried = [self.fleet.pick("prefill", call.route)]
        try:
            while True:
                instance = tried[-1]
                ticket = instance.service.prompt_started(_uncached(call))
                try:
                    try:
                        status, raw, headers = await self.calls.prefill(call, instance, body)
                        if status == 200:
                            # vLLM's answer does not say how many tokens it computed: the
                            # estimate stands.
                            instance.service.prompt_done(ticket)
                    finally:
                        instance.service.prompt_abandoned(ticket)  # failed: no sample
                    if 400 <= status < 500:
                        return passed_through(instance, call.request_id, status, raw, headers)
                    if status != 200:
                        raise vllm_error(instance, status, raw)
                    params = kv_transfer_params(instance, raw, call.log)
                except UpstreamError as exc:
                    await self._retry(call, tried, exc)
                    continue
                instance.succeeded()
                # vLLM puts the prefill's prefix-cache hit in the params it returns (the decode
                # reports it as the request's cached_tokens).
                self._prediction(call, "prefill", (params or {}).get(REMOTE_CACHED_KEY))
                return params
        finally:
            for instance in tried:
                self.fleet.release(instance)

    async def _decode_once(
        self, call: VllmCall, instance: Instance, params: dict[str, Any] | None
    ) -> web.StreamResponse:
        body = dict(call.body)
        if params is not None:
            body["kv_transfer_params"] = params
        # A decode alone computes the prompt: timed up to its first streamed event.
        ticket = instance.service.prompt_started(_uncached(call)) if params is None else None
        try:
            return await self._decode_answer(call, instance, params, body, ticket)
        finally:
            if ticket is not None:
                instance.service.prompt_abandoned(ticket)

    async def _decode_answer(
        self,
        call: VllmCall,
        instance: Instance,
        params: dict[str, Any] | None,
        body: dict[str, Any],
        ticket: PromptTicket | None,
    ) -> web.StreamResponse:
        upstream = await self.calls.decode(call, instance, body)
        async with upstream:
            status = upstream.status
            if status != 200 and not 400 <= status < 500:
                raw = await read_or_empty(upstream)
                raise vllm_error(instance, status, raw)
            if status != 200 or "text/event-stream" not in upstream.content_type:
                try:
                    raw = await read_bounded(upstream, instance, MAX_ANSWER_BYTES)
                except TimeoutError:
                    # Its headers came: the request's length, not a dead instance.
                    raise deadline_error(instance) from None
                except aiohttp.ClientError as exc:
                    instance.failed()
                    raise cut_error(instance, exc) from None
                if status == 200:
                    instance.succeeded()
                    self.metrics.first_token(time.monotonic() - call.started)
                    if self._decode_predicted(call, params):
                        self._prediction(call, "decode", reported_cached_tokens(raw))
                answer = passed_through(instance, call.request_id, status, raw, upstream.headers)
                if call.decision is not None:
                    answer.headers[ROUTE_HEADER] = route_header(call.decision)
                return answer
            response, tail = await self._stream(call, instance, upstream, ticket)
            if tail is not None and self._decode_predicted(call, params):
                self._prediction(call, "decode", streamed_cached_tokens(tail))
            return response

    async def _stream(
        self,
        call: VllmCall,
        instance: Instance,
        upstream: aiohttp.ClientResponse,
        ticket: PromptTicket | None,
    ) -> tuple[web.StreamResponse, bytes | None]:
        """vLLM's events as they come, and the stream's last bytes when it ended with
        ``[DONE]``; the client's response opens at the first byte, so a decode that fails
        before it is still retried. The gaps between events feed the instance's
        `ServiceStats` (and its first event ends ``ticket``'s prompt)."""
        timer = _EventTimer(instance.service, ticket, call.outcome)
        try:
            return await self._relay(call, instance, upstream, timer)
        finally:
            timer.close()

    async def _relay(
        self,
        call: VllmCall,
        instance: Instance,
        upstream: aiohttp.ClientResponse,
        timer: _EventTimer,
    ) -> tuple[web.StreamResponse, bytes | None]:
        response: web.StreamResponse | None = None
        tail = b""
        try:
            async for chunk in upstream.content.iter_any():
                timer.chunk(chunk)
                tail = (tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
                if response is None:
                    response = web.StreamResponse(headers=answer_headers(call, upstream.headers))
                    await response.prepare(call.request)
                    self.metrics.first_token(time.monotonic() - call.started)
                try:
                    await response.write(chunk)
                except ConnectionResetError:
                    # Leaving closes the decode's connection: vLLM aborts the request.
                    raise ClientGone(response) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, TimeoutError):
                # The request's deadline, on a decode that answered: not its fault.
                failure = deadline_error(instance)
            else:
                instance.failed()
                failure = cut_error(instance, exc)
        else:
            if response is None:
                raise vllm_error(instance, 502, b"the stream ended before any event")
            # Closed cleanly but short of vLLM's last event: a client would take the text so
            # far for the whole answer.
            failure = None if ends_done(tail) else truncated_error(instance)
            if failure is not None:
                instance.failed()
        if response is None:
            raise failure from None
        if failure is not None:
            self.metrics.upstream_error(failure.role, failure.reason)
            call.log.warning("failed mid-stream: %s", failure)
            event = json.dumps(error_body(str(failure), "upstream_error"))
            response[FAILED_ANSWER] = FailedAnswer(str(failure), mid_stream=True)
            closing = closing_bytes(tail) + f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await response.write(closing)
            return response, None
        instance.succeeded()
        await response.write_eof()
        return response, tail

    @staticmethod
    def _decode_predicted(call: VllmCall, params: dict[str, Any] | None) -> bool:
        """Whether the decode computed the prompt (no params) and its policy predicted its hit:
        only then is its answer read for the hit it reports."""
        return params is None and "decode" in call.route.predicted_cached_tokens

    def _prediction(self, call: VllmCall, role: str, reported: object) -> None:
        """The ``role`` policy's cached-token prediction at the pick against what vLLM reported
        (counted only when both are known)."""
        predicted = call.route.predicted_cached_tokens.get(role)
        if predicted is None or isinstance(reported, bool) or not isinstance(reported, int):
            return
        if 0 <= reported <= _MAX_CACHED_TOKENS:
            self.metrics.cache_prediction(role, predicted, reported)

    async def _retry(
        self,
        call: VllmCall,
        tried: list[Instance],
        exc: UpstreamError,
        aggregated: bool | None = None,
    ) -> None:
        """Another instance of ``exc``'s role (``aggregated``: see `Fleet.pick`) appended to
        ``tried`` after a back-off; raises ``exc`` when it is not retryable, the retries are
        spent, or none is left to try."""
        attempt = len(tried)
        if not exc.retryable or attempt > self.config.max_retries:
            raise exc
        await retry_pause(attempt, call.deadline)
        try:
            instance = self.fleet.pick(exc.role, call.route, exclude=tried, aggregated=aggregated)
        except NoHealthyDaemon:
            raise exc from None
        call.log.warning("%s; retry %d on %s %s", exc, attempt, exc.role, instance.address)
        self.metrics.upstream_error(exc.role, exc.reason)
        self.metrics.retry(exc.role, exc.reason)
        tried.append(instance)


def _max_tokens(body: dict[str, Any]) -> int:
    """The request's output bound as the decision reads it (vLLM's own default when unset)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return VLLM_DEFAULT_MAX_TOKENS


def _uncached(call: VllmCall) -> int:
    decision = call.decision
    if decision is not None and decision.uncached_tokens is not None:
        return decision.uncached_tokens
    return len(call.route.token_ids or ())


class _EventTimer:
    """Times one decode stream's server-sent events for its instance's `ServiceStats`: each
    ``data:`` event but ``[DONE]`` counts as one token (vLLM streams a token per event)."""

    def __init__(
        self, service: ServiceStats, ticket: PromptTicket | None, outcome: SloOutcome | None
    ) -> None:
        self._service = service
        self._ticket = ticket
        self._outcome = outcome
        self._first: float | None = None
        self._last: float | None = None
        self._events_after_first = 0

    def chunk(self, chunk: bytes) -> None:
        events = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        if events <= 0:
            return
        if self._outcome is not None:
            self._outcome.tokens(events)
        now = time.monotonic()
        if self._last is None:
            if self._ticket is not None:
                self._service.prompt_done(self._ticket)
            self._service.decoding += 1
            self._first = now
        else:
            self._service.token_gap(now - self._last, events)
            self._events_after_first += events
        self._last = now

    def close(self) -> None:
        if self._last is None:
            return
        self._service.decoding -= 1
        if self._ticket is not None and self._first is not None and self._events_after_first:
            # Run whole here (no params): the gap it got, stalls included.
            gap = (self._last - self._first) / self._events_after_first
            self._service.alone_decoded(gap)
        self._last = None
