"""The router's HTTP error answers, all in OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}`` with the request's ``x-request-id``: aiohttp's own (unknown path, wrong
method), a body too large, an unknown model, and upstream failures (their status, and
``Retry-After`` when no instance of a role could be picked)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvtransfer.router.echo import echo
from kvtransfer.router.errors import FAILED_ANSWER, FailedAnswer, NoHealthyDaemon, UpstreamError
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.openai.requests import error_body

logger = logging.getLogger("kvtransfer.router")


@web.middleware
async def openai_errors(
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


def error_kind(status: int) -> str:
    # OpenAI's type for the client's own mistakes; anything upstream-side is ours to own.
    return "invalid_request_error" if status < 500 else "upstream_error"


def error_response(
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
    response = web.json_response(body, status=status, headers=headers)
    response[FAILED_ANSWER] = FailedAnswer(message)
    return response


def unknown_model(
    served: str, request_id: str, log: logging.LoggerAdapter[logging.Logger], model: object
) -> web.Response:
    log.info("rejected (404): unknown model %s", echo(model))
    message = f"model {echo(model)} does not exist (this router serves {served!r})"
    return error_response(request_id, 404, message, param="model", code="model_not_found")


def too_large(
    request_id: str, log: logging.LoggerAdapter[logging.Logger], request: web.Request
) -> web.Response:
    message = (
        f"the request body is larger than {request.client_max_size} bytes, "
        "this router's limit (--max-request-bytes)"
    )
    log.info("rejected (413): %s", message)
    return error_response(request_id, 413, message, code="request_too_large")


def upstream_failure(
    metrics: RouterMetrics,
    health_interval_s: float,
    request_id: str,
    log: logging.LoggerAdapter[logging.Logger],
    exc: UpstreamError,
) -> web.Response:
    count_failure(metrics, request_id, exc)
    code, headers = None, None
    if isinstance(exc, NoHealthyDaemon):
        # A health check or a DNS resolution may change that: try again after one.
        code = exc.reason
        headers = {"Retry-After": str(max(1, math.ceil(health_interval_s)))}
    kind = error_kind(exc.status)
    return error_response(request_id, exc.status, str(exc), kind=kind, code=code, headers=headers)


def count_failure(metrics: RouterMetrics, request_id: str, exc: UpstreamError) -> None:
    logger.warning("failed (%d): %s", exc.status, exc, extra={"request_id": request_id})
    metrics.upstream_error(exc.role, exc.reason)
