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
   understood the body), for ``cache_aware`` and ``disagg_min_prompt_tokens``.
2. Pick the decode instance first (the decode policy weighs aggregated instances, ``kv_both``
   servers listed with ``--aggregated``, with the others; with no prefill to pick, only they
   can serve): with none, 503 before any prefill holds KV for nobody. An aggregated instance,
   or a prompt with fewer uncached tokens than ``disagg_min_prompt_tokens``, goes to it alone
   (step 5 without params). Otherwise a prefill instance is picked too.
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

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
from aiohttp import web

from kvtransfer.router.choice import goes_alone, retry_pause
from kvtransfer.router.config import RouterConfig
from kvtransfer.router.errors import ClientGone, NoHealthyDaemon, UpstreamError
from kvtransfer.router.fleet.fleet import Fleet
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.fleet.vllm_endpoint import VllmEndpoint, read_at_most
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.names import AGGREGATED
from kvtransfer.router.openai.requests import InvalidRequest, error_body, parse_json_body
from kvtransfer.router.routing.policy import RouteContext

# What vLLM adds to a prefill's kv_transfer_params: the prompt tokens its prefix cache served.
REMOTE_CACHED_KEY = "remote_prefill_cached_tokens"
# Decode answers up to this size are parsed for their usage (a metric; logprobs make larger).
_USAGE_READ_BYTES = 1 << 20
# The last bytes of a stream kept: whether it ended with ``data: [DONE]``, and the usage chunk
# before it.
_TAIL_BYTES = 4096
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
REQUEST_ID_HEADER = "X-Request-Id"
# vLLM's answer headers that describe the bytes passed through (the rest are hop-by-hop or
# aiohttp's own).
_PASSED_HEADERS = ("Content-Type", "Cache-Control")
# The most of a JSON answer (a decode's, an error) the router holds in memory to pass on: far
# above one sample's answer (100,000 tokens with 20 log-probabilities each fit), far below
# what would hurt the router with many at once.
MAX_ANSWER_BYTES = 64 * 2**20
# What of a 5xx's body is read, and of its message goes into the router's error.
_ERROR_BYTES = 2**20
_MESSAGE_CHARS = 300


def check_vllm_body(body: Any) -> dict[str, Any]:
    """The client's body as far as the flow needs it: a JSON object asking for one sample."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1:
            raise InvalidRequest(
                f"{name} must be 1 behind a P/D router of vLLM servers (got {value!r}): the "
                "samples of one request would share one kv_transfer_params; send one request "
                "per sample",
                name,
            )
    if body.get("kv_transfer_params") is not None:
        raise InvalidRequest(
            "kv_transfer_params is set by this router (a decode's come from its prefill's "
            "answer): leave it out of the request",
            "kv_transfer_params",
        )
    prompt = body.get("prompt")
    # A list of token ids is one prompt; a list holding strings or lists is a batch.
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and any(isinstance(p, (str, list)) for p in prompt)
    ):
        raise InvalidRequest(
            f"prompt must be one prompt behind a P/D router of vLLM servers (got a batch of "
            f"{len(prompt)}): vLLM answers one kv_transfer_params for a batch, so every "
            "prompt but the first would be decoded with the first one's KV; send one request "
            "per prompt",
            "prompt",
        )
    return body


@dataclass
class VllmCall:
    """One request on a vLLM fleet."""

    request: web.Request
    request_id: str
    body: dict[str, Any]
    route: RouteContext
    started: float
    deadline: float
    log: logging.LoggerAdapter[logging.Logger]

    @property
    def path(self) -> str:
        return self.request.path


class VllmProxy:
    """Runs `VllmCall` s on ``fleet`` (whose instances are `VllmEndpoint` s)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, fleet: Fleet) -> None:
        self.config = config
        self.metrics = metrics
        self.fleet = fleet

    async def serve(self, call: VllmCall) -> web.StreamResponse:
        """The client's answer: the decode's, passed through; raises `UpstreamError` when no
        instance of a role could do its part (the app answers it)."""
        fleet = self.fleet
        can_prefill = fleet.any_pickable("prefill")
        if not can_prefill and not fleet.any_pickable(AGGREGATED):
            fleet.require_pickable("decode")
            fleet.require_pickable("prefill")
        decode = fleet.pick("decode", call.route, aggregated=None if can_prefill else True)
        tried = [decode]
        try:
            params: dict[str, Any] | None = None
            if decode.aggregated:
                self.metrics.route_mode("aggregated")
            elif goes_alone(fleet, self.config.disagg_min_prompt_tokens, call.route):
                self.metrics.route_mode("decode_only")
            else:
                self.metrics.route_mode("disaggregated")
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

    # ------------------------------------------------------------------ the prefill

    async def _prefill(self, call: VllmCall) -> dict[str, Any] | web.Response | None:
        """The prefill's ``kv_transfer_params`` (None: it gave none), or vLLM's refusal of the
        input as the client's answer."""
        body = {k: v for k, v in call.body.items() if k not in _PREFILL_DROPS}
        body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        tried = [self.fleet.pick("prefill", call.route)]
        try:
            while True:
                instance = tried[-1]
                try:
                    status, raw, headers = await self._post(call, instance, body)
                    if 400 <= status < 500:
                        return _passed_through(call.request_id, status, raw, headers)
                    if status != 200:
                        raise _vllm_error(instance, status, raw)
                    params = _kv_transfer_params(instance, raw, call.log)
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

    # ------------------------------------------------------------------ the decode

    async def _decode_once(
        self, call: VllmCall, instance: Instance, params: dict[str, Any] | None
    ) -> web.StreamResponse:
        body = dict(call.body)
        if params is not None:
            body["kv_transfer_params"] = params
        endpoint = _endpoint(instance)
        try:
            upstream = await endpoint.session.post(
                endpoint.url(call.path),
                json=body,
                headers=self._headers(call),
                timeout=self._timeout(call),
                allow_redirects=False,
            )
        except TimeoutError:  # an OSError too: first
            raise self._silent(instance) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._unreachable(instance, exc) from None
        async with upstream:
            status = upstream.status
            if status != 200 and not 400 <= status < 500:
                raw = await _read_or_empty(upstream)
                raise _vllm_error(instance, status, raw)
            if status != 200 or "text/event-stream" not in upstream.content_type:
                try:
                    raw = await _read_bounded(upstream, instance, MAX_ANSWER_BYTES)
                except TimeoutError:
                    # Its headers came: the request's length, not a dead instance.
                    raise _deadline(instance) from None
                except aiohttp.ClientError as exc:
                    instance.failed()
                    raise _cut(instance, exc) from None
                if status == 200:
                    instance.succeeded()
                    self.metrics.first_token(time.monotonic() - call.started)
                    if self._decode_predicted(call, params):
                        self._prediction(call, "decode", _reported_cached_tokens(raw))
                return _passed_through(call.request_id, status, raw, upstream.headers)
            response, tail = await self._stream(call, instance, upstream)
            if tail is not None and self._decode_predicted(call, params):
                self._prediction(call, "decode", _streamed_cached_tokens(tail))
            return response

    async def _stream(
        self, call: VllmCall, instance: Instance, upstream: aiohttp.ClientResponse
    ) -> tuple[web.StreamResponse, bytes | None]:
        """vLLM's events as they come, and the stream's last bytes when it ended with
        ``[DONE]``; the client's response opens at the first byte, so a decode that fails
        before it is still retried."""
        response: web.StreamResponse | None = None
        tail = b""
        try:
            async for chunk in upstream.content.iter_any():
                tail = (tail + chunk[-_TAIL_BYTES:])[-_TAIL_BYTES:]
                if response is None:
                    response = web.StreamResponse(headers=_answer_headers(call, upstream.headers))
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
                failure = _deadline(instance)
            else:
                instance.failed()
                failure = _cut(instance, exc)
        else:
            if response is None:
                raise _vllm_error(instance, 502, b"the stream ended before any event")
            # Closed cleanly but short of vLLM's last event: a client would take the text so
            # far for the whole answer.
            failure = None if _ends_done(tail) else _truncated(instance)
            if failure is not None:
                instance.failed()
        if response is None:
            raise failure from None
        if failure is not None:
            self.metrics.upstream_error(failure.role, failure.reason)
            call.log.warning("failed mid-stream: %s", failure)
            event = json.dumps(error_body(str(failure), "upstream_error"))
            closing = _closing(tail) + f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await response.write(closing)
            return response, None
        instance.succeeded()
        await response.write_eof()
        return response, tail

    # ------------------------------------------------------------------ helpers

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

    async def _post(
        self, call: VllmCall, instance: Instance, body: dict[str, Any]
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """The prefill's status, body (at most ``max_request_bytes``: its params go into the
        decode's body) and headers."""
        endpoint = _endpoint(instance)
        try:
            async with endpoint.session.post(
                endpoint.url(call.path),
                json=body,
                headers=self._headers(call),
                timeout=self._timeout(call),
                allow_redirects=False,
            ) as response:
                raw = await _read_bounded(response, instance, self.config.max_request_bytes)
                return response.status, raw, response.headers
        except TimeoutError:  # an OSError too: first
            raise self._silent(instance) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise self._unreachable(instance, exc) from None

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

    def _headers(self, call: VllmCall) -> dict[str, str]:
        """One request id on both calls; the servers' own API key, never the client's."""
        headers = {REQUEST_ID_HEADER: call.request_id}
        if self.config.vllm_api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.vllm_api_key}"
        return headers

    def _timeout(self, call: VllmCall) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=max(0.001, call.deadline - time.monotonic()))

    def _silent(self, instance: Instance) -> UpstreamError:
        """Nothing came back within the request's deadline: as for a daemon (`fleet`), the
        instance leaves the pool until a health check finds it serving, so a wedged server is
        not picked again meanwhile."""
        self.fleet.eject(instance, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")
        return _deadline(instance)

    def _unreachable(self, instance: Instance, exc: BaseException) -> UpstreamError:
        """No answer at all: the instance leaves the pool until a health check finds it."""
        detail = str(exc) or type(exc).__name__
        self.fleet.eject(instance, grpc.StatusCode.UNAVAILABLE, detail)
        instance.failed()
        return UpstreamError(503, f"unreachable: {detail}", instance.role, instance.address)


def _endpoint(instance: Instance) -> VllmEndpoint:
    channel = instance.channel
    if not isinstance(channel, VllmEndpoint):
        raise TypeError(f"{instance.name} is not a vLLM server (the router's --engine)")
    return channel


def _kv_transfer_params(
    instance: Instance, raw: bytes, log: logging.LoggerAdapter[logging.Logger]
) -> dict[str, Any] | None:
    """The params in a prefill's 200 answer; `_unusable` (counted on its breaker) when the
    answer is not what vLLM writes."""
    try:
        # The checks of a client's body: UTF-8 JSON, nested no deeper than the router takes
        # (the params go on into the decode's body).
        answer = parse_json_body(raw)
    except InvalidRequest as exc:
        raise _unusable(instance, str(exc).replace("the request body", "it")) from None
    if not isinstance(answer, dict):
        raise _unusable(instance, f"it is a JSON {type(answer).__name__}, not an object")
    params = answer.get("kv_transfer_params")
    if params is None:
        log.info("%s gave no kv_transfer_params: the decode computes the prompt", instance.name)
        return None
    if not isinstance(params, dict):
        raise _unusable(instance, "its kv_transfer_params are not an object")
    return params


def _reported_cached_tokens(raw: bytes) -> object:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON answer (vLLM writes it with
    ``--enable-prompt-tokens-details``); None when absent or unreadable, or in an answer over
    `_USAGE_READ_BYTES` (parsing it would stall the router's event loop for a metric)."""
    if len(raw) > _USAGE_READ_BYTES:
        return None
    try:
        usage = json.loads(raw).get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError, RecursionError):
        return None


def _unusable(instance: Instance, why: str) -> UpstreamError:
    """A 200 answer that is not vLLM's: the instance's fault, worth another one."""
    instance.failed()
    return UpstreamError(
        502, f"its answer is unusable: {why}", instance.role, instance.address, "bad_answer"
    )


def _vllm_error(instance: Instance, status: int, raw: bytes) -> UpstreamError:
    """A 5xx of vLLM's own, or a status vLLM does not answer (a redirect): 502, counted on its
    breaker, worth another instance."""
    instance.failed()
    message: object = raw.decode(errors="replace").strip() or "(empty body)"
    # RecursionError: a body nested deeper than the parser goes.
    with contextlib.suppress(ValueError, KeyError, TypeError, RecursionError):
        message = json.loads(raw)["error"]["message"]
    text = str(message)
    if len(text) > _MESSAGE_CHARS:
        text = text[:_MESSAGE_CHARS] + "..."
    return UpstreamError(
        502, f"HTTP {status}: {text}", instance.role, instance.address, f"http_{status}"
    )


class AnswerTooLarge(UpstreamError):
    """An answer over the router's bound: another instance would answer as much."""

    @property
    def retryable(self) -> bool:
        return False


async def _read_bounded(response: aiohttp.ClientResponse, instance: Instance, limit: int) -> bytes:
    raw = await read_at_most(response, limit)
    if raw is None:
        message = f"its answer is larger than {limit} bytes, this router's limit"
        raise AnswerTooLarge(502, message, instance.role, instance.address, "answer_too_large")
    return raw


def _cut(instance: Instance, exc: BaseException) -> UpstreamError:
    detail = str(exc) or type(exc).__name__
    return UpstreamError(
        502, f"its answer was cut: {detail}", instance.role, instance.address, "cut"
    )


def _truncated(instance: Instance) -> UpstreamError:
    message = "its stream ended without vLLM's last event (data: [DONE])"
    return UpstreamError(502, message, instance.role, instance.address, "truncated")


def _streamed_cached_tokens(tail: bytes) -> object:
    """The ``cached_tokens`` of the event before ``[DONE]`` (vLLM's usage chunk, sent with
    ``stream_options.include_usage``); None when it is not there or not whole in ``tail``."""
    events = [e.strip() for e in tail.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if len(events) < 2 or not events[-2].startswith(b"data:"):
        return None
    return _reported_cached_tokens(events[-2].removeprefix(b"data:"))


def _closing(tail: bytes) -> bytes:
    """What ends the event a stream's ``tail`` left open: glued to a partial event of vLLM's,
    the router's error event would be unreadable, and a client skipping what it cannot parse
    would meet ``[DONE]`` and take the answer for complete."""
    if not tail or tail.endswith((b"\n\n", b"\r\n\r\n")):
        return b""
    return b"\n" if tail.endswith(b"\n") else b"\n\n"


def _ends_done(tail: bytes) -> bool:
    """Whether a stream's last line is its ``[DONE]`` event (LF or CRLF line ends; the space
    after ``data:`` is optional in server-sent events)."""
    last = tail.rstrip(b"\r\n").rsplit(b"\n", 1)[-1]
    return last in (b"data: [DONE]", b"data:[DONE]")


def _deadline(instance: Instance) -> UpstreamError:
    return UpstreamError(
        503,
        "no answer within the request deadline (--request-timeout-s)",
        instance.role,
        instance.address,
        "DEADLINE_EXCEEDED",
    )


async def _read_or_empty(response: aiohttp.ClientResponse) -> bytes:
    """An error's body, as far as it can say why (empty when it could not be read)."""
    try:
        raw = await read_at_most(response, _ERROR_BYTES)
    except (TimeoutError, aiohttp.ClientError):
        return b""
    return f"(a body over {_ERROR_BYTES} bytes)".encode() if raw is None else raw


def _answer_headers(call: VllmCall, upstream: Mapping[str, str]) -> dict[str, str]:
    headers = {name: upstream[name] for name in _PASSED_HEADERS if name in upstream}
    headers["x-request-id"] = call.request_id
    # Reverse proxies (nginx) would otherwise buffer a stream and defeat it.
    headers["X-Accel-Buffering"] = "no"
    return headers


def _passed_through(
    request_id: str, status: int, raw: bytes, upstream: Mapping[str, str]
) -> web.Response:
    headers = {name: upstream[name] for name in _PASSED_HEADERS if name in upstream}
    headers["x-request-id"] = request_id
    return web.Response(status=status, body=raw, headers=headers)
