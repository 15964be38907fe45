"""Reading vLLM's answers: a prefill's ``kv_transfer_params``, the cached-token counts a
decode reports (JSON or the last events of a stream), how a stream ended, and answers passed
through to the client; every read bounded."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from kvtransfer.router.errors import FAILED_ANSWER, FailedAnswer
from kvtransfer.router.fleet.instance import Instance
from kvtransfer.router.fleet.vllm_endpoint import VllmEndpoint, read_at_most
from kvtransfer.router.openai.requests import InvalidRequest, parse_json_body
from kvtransfer.router.routing.disagg import RouteDecision
from kvtransfer.router.vllm_flow.failures import AnswerTooLarge, unusable_answer
from kvtransfer.router.vllm_flow.request import VllmCall

# Decode answers up to this size are parsed for their usage (a metric; logprobs make larger).
USAGE_READ_BYTES = 1 << 20
# The last bytes of a stream kept: whether it ended with ``data: [DONE]``, and the usage chunk
# before it.
TAIL_BYTES = 4096
# vLLM's answer headers that describe the bytes passed through (the rest are hop-by-hop or
# aiohttp's own).
PASSED_HEADERS = ("Content-Type", "Cache-Control")
# What of a 5xx's body is read, and of its message goes into the router's error.
ERROR_BYTES = 2**20


def endpoint_of(instance: Instance) -> VllmEndpoint:
    channel = instance.channel
    if not isinstance(channel, VllmEndpoint):
        raise TypeError(f"{instance.name} is not a vLLM server (the router's --engine)")
    return channel


def kv_transfer_params(
    instance: Instance, raw: bytes, log: logging.LoggerAdapter[logging.Logger]
) -> dict[str, Any] | None:
    """The params in a prefill's 200 answer; `unusable` (counted on its breaker) when the
    answer is not what vLLM writes."""
    try:
        # The checks of a client's body: UTF-8 JSON, nested no deeper than the router takes
        # (the params go on into the decode's body).
        answer = parse_json_body(raw)
    except InvalidRequest as exc:
        raise unusable_answer(instance, str(exc).replace("the request body", "it")) from None
    if not isinstance(answer, dict):
        raise unusable_answer(instance, f"it is a JSON {type(answer).__name__}, not an object")
    params = answer.get("kv_transfer_params")
    if params is None:
        log.info("%s gave no kv_transfer_params: the decode computes the prompt", instance.name)
        return None
    if not isinstance(params, dict):
        raise unusable_answer(instance, "its kv_transfer_params are not an object")
    return params


def reported_cached_tokens(raw: bytes) -> object:
    """``usage.prompt_tokens_details.cached_tokens`` of a JSON answer (vLLM writes it with
    ``--enable-prompt-tokens-details``); None when absent or unreadable, or in an answer over
    `USAGE_READ_BYTES` (parsing it would stall the router's event loop for a metric)."""
    if len(raw) > USAGE_READ_BYTES:
        return None
    try:
        usage = json.loads(raw).get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except (ValueError, AttributeError, RecursionError):
        return None


async def read_bounded(response: aiohttp.ClientResponse, instance: Instance, limit: int) -> bytes:
    raw = await read_at_most(response, limit)
    if raw is None:
        message = f"its answer is larger than {limit} bytes, this router's limit"
        raise AnswerTooLarge(502, message, instance.role, instance.address, "answer_too_large")
    return raw


def streamed_cached_tokens(tail: bytes) -> object:
    """The ``cached_tokens`` of the event before ``[DONE]`` (vLLM's usage chunk, sent with
    ``stream_options.include_usage``); None when it is not there or not whole in ``tail``."""
    events = [e.strip() for e in tail.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    if len(events) < 2 or not events[-2].startswith(b"data:"):
        return None
    return reported_cached_tokens(events[-2].removeprefix(b"data:"))


def closing_bytes(tail: bytes) -> bytes:
    """What ends the event a stream's ``tail`` left open: glued to a partial event of vLLM's,
    the router's error event would be unreadable, and a client skipping what it cannot parse
    would meet ``[DONE]`` and take the answer for complete."""
    if not tail or tail.endswith((b"\n\n", b"\r\n\r\n")):
        return b""
    return b"\n" if tail.endswith(b"\n") else b"\n\n"


def ends_done(tail: bytes) -> bool:
    """Whether a stream's last line is its ``[DONE]`` event (LF or CRLF line ends; the space
    after ``data:`` is optional in server-sent events)."""
    last = tail.rstrip(b"\r\n").rsplit(b"\n", 1)[-1]
    return last in (b"data: [DONE]", b"data:[DONE]")


async def read_or_empty(response: aiohttp.ClientResponse) -> bytes:
    """An error's body, as far as it can say why (empty when it could not be read)."""
    try:
        raw = await read_at_most(response, ERROR_BYTES)
    except (TimeoutError, aiohttp.ClientError):
        return b""
    return f"(a body over {ERROR_BYTES} bytes)".encode() if raw is None else raw


# vLLM's answer is passed through as it came, so the route decision travels in a header:
# "MODE; reason=REASON; uncached_tokens=N".
ROUTE_HEADER = "x-kvtransfer-route"


def route_header(decision: RouteDecision) -> str:
    value = f"{decision.mode}; reason={decision.reason}"
    if decision.uncached_tokens is not None:
        value += f"; uncached_tokens={decision.uncached_tokens}"
    for name, seconds in decision.predicted.items():
        value += f"; {name}={seconds:.6g}"
    return value


def answer_headers(call: VllmCall, upstream: Mapping[str, str]) -> dict[str, str]:
    headers = {name: upstream[name] for name in PASSED_HEADERS if name in upstream}
    headers["x-request-id"] = call.request_id
    if call.decision is not None:
        headers[ROUTE_HEADER] = route_header(call.decision)
    # Reverse proxies (nginx) would otherwise buffer a stream and defeat it.
    headers["X-Accel-Buffering"] = "no"
    return headers


def passed_through(
    instance: Instance, request_id: str, status: int, raw: bytes, upstream: Mapping[str, str]
) -> web.Response:
    """vLLM's answer as it came; a refusal (4xx) is recorded by who refused and its status
    alone (its body is vLLM's text, echoing the client's input, up to `MAX_ANSWER_BYTES`)."""
    headers = {name: upstream[name] for name in PASSED_HEADERS if name in upstream}
    headers["x-request-id"] = request_id
    response = web.Response(status=status, body=raw, headers=headers)
    if status >= 400:
        message = f"{instance.name} refused the request (HTTP {status}); its answer went to the "
        message += "client as vLLM wrote it"
        response[FAILED_ANSWER] = FailedAnswer(message)
    return response
