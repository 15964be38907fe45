"""The router's HTTP app: OpenAI ``/v1/completions`` in front of prefill and decode daemons.

Life cycle of a request:

1. ``POST /v1/completions`` arrives; the body is validated (400 naming the field otherwise) and
   gets one id, ``cmpl-<hex>``, used on both daemons and in every log line.
2. A prefill daemon (round-robin) runs it with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``; its final message carries the params a
   decode engine pulls the prompt's KV with.
3. A decode daemon (round-robin) gets the same id, the original prompt and sampling options and
   those params; it pulls the KV over UCX and streams tokens.
4. Tokens go back as one JSON body, or as server-sent events ending with ``data: [DONE]``.
5. A daemon that fails becomes an HTTP error naming it and the reason (502/503/504; 400 for
   input it refused); every upstream call has a deadline; a client that disconnects cancels
   the upstream calls, which aborts the request on the daemons.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.openai_api import (
    CompletionRequest,
    InvalidRequest,
    completion_body,
    error_body,
    parse_completion_request,
)
from kvtransfer.router.upstream import Upstream, UpstreamError

logger = logging.getLogger("kvtransfer.router")

_HEALTH_TIMEOUT_S = 1.0


@dataclass
class _Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    first_token_at: float | None = None
    final: Any = None


class RouterApp:
    def __init__(self, upstream: Upstream, model_name: str) -> None:
        self.upstream = upstream
        self.model_name = model_name
        self.metrics = RouterMetrics()

    def build(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        await self.upstream.close()

    # ------------------------------------------------------------------ endpoints

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "owned_by": "kvtransfer"}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        prefill = await self.upstream.prefill.health(_HEALTH_TIMEOUT_S)
        decode = await self.upstream.decode.health(_HEALTH_TIMEOUT_S)
        ok = "SERVING" in prefill.values() and "SERVING" in decode.values()
        body = {"status": "ok" if ok else "unavailable", "prefill": prefill, "decode": decode}
        return web.json_response(body, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        log = {"extra": {"request_id": request_id}}
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise InvalidRequest("the request body is not valid JSON", None) from None
            parsed = parse_completion_request(body)
            if parsed.model is not None and parsed.model != self.model_name:
                return self._error(
                    404, f"model {parsed.model!r} does not exist", "not_found_error", "model"
                )
        except InvalidRequest as exc:
            logger.info("rejected: %s", exc, **log)
            return self._error(400, str(exc), "invalid_request_error", exc.param)
        logger.info("received (stream=%s)", parsed.stream, **log)
        try:
            prefill = await self.upstream.run_prefill(request_id, parsed, self.upstream.timeout_s)
            decode = self.upstream.pick_decode()
            replies = self.upstream.run_decode(
                decode,
                request_id,
                parsed,
                prefill.kv_transfer_params_json,
                max(0.1, self.upstream.timeout_s - (time.monotonic() - started)),
            )
            route = {"prefill": prefill.daemon.address, "decode": decode.address}
            if parsed.stream:
                return await self._stream(request, request_id, parsed, replies, route, started)
            return await self._collect(request_id, parsed, replies, route, started)
        except UpstreamError as exc:
            logger.warning("failed: %s", exc, **log)
            self.metrics.upstream_error(exc.role, exc.status)
            return self._error(exc.status, str(exc), "upstream_error")

    # ------------------------------------------------------------------ responses

    async def _collect(
        self,
        request_id: str,
        parsed: CompletionRequest,
        replies: Any,
        route: dict[str, str],
        started: float,
    ) -> web.Response:
        outcome = _Outcome()
        async for reply in replies:
            self._absorb(outcome, reply)
        if outcome.finish_reason == "error":
            reason = outcome.final.error if outcome.final is not None else "failed"
            self.metrics.upstream_error("decode", 502)
            return self._error(502, f"decode daemon {route['decode']}: {reason}", "upstream_error")
        self.metrics.finished(200, started, outcome.first_token_at)
        usage = {
            "prompt_tokens": outcome.num_prompt_tokens,
            "completion_tokens": len(outcome.token_ids),
            "total_tokens": outcome.num_prompt_tokens + len(outcome.token_ids),
        }
        info = self._info(request_id, outcome, route, started)
        body = completion_body(
            request_id, self.model_name, outcome.text, outcome.finish_reason, usage, info
        )
        logger.info("done: %d tokens", len(outcome.token_ids), extra={"request_id": request_id})
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        parsed: CompletionRequest,
        replies: Any,
        route: dict[str, str],
        started: float,
    ) -> web.StreamResponse:
        outcome = _Outcome()
        response: web.StreamResponse | None = None
        try:
            async for reply in replies:
                self._absorb(outcome, reply)
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                if reply.finished:
                    break
                if reply.text:
                    chunk = completion_body(
                        request_id, self.model_name, reply.text, None, None, None
                    )
                    await response.write(_sse(chunk))
        except UpstreamError as exc:
            if response is None:
                raise
            self.metrics.upstream_error(exc.role, exc.status)
            await response.write(_sse(error_body(str(exc), "upstream_error")))
            await response.write(b"data: [DONE]\n\n")
            return response
        if response is None:
            raise UpstreamError(502, "decode", route["decode"], "the stream ended without output")
        final = outcome.final
        if outcome.finish_reason == "error":
            reason = f"decode daemon {route['decode']}: {final.error if final else 'failed'}"
            self.metrics.upstream_error("decode", 502)
            await response.write(_sse(error_body(reason, "upstream_error")))
        else:
            last_text = final.text if final is not None else ""
            info = self._info(request_id, outcome, route, started)
            chunk = completion_body(
                request_id, self.model_name, last_text, outcome.finish_reason, None, info
            )
            await response.write(_sse(chunk))
            self.metrics.finished(200, started, outcome.first_token_at)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _absorb(outcome: _Outcome, reply: Any) -> None:
        if reply.token_ids and outcome.first_token_at is None:
            outcome.first_token_at = time.monotonic()
        outcome.token_ids.extend(reply.token_ids)
        outcome.text += reply.text
        if reply.num_prompt_tokens:
            outcome.num_prompt_tokens = reply.num_prompt_tokens
        if reply.finished:
            outcome.finish_reason = reply.finish_reason
            outcome.final = reply

    @staticmethod
    def _info(
        request_id: str, outcome: _Outcome, route: dict[str, str], started: float
    ) -> dict[str, Any]:
        metrics = outcome.final.metrics if outcome.final is not None else None
        first = outcome.first_token_at
        return {
            "request_id": request_id,
            **route,
            "token_ids": outcome.token_ids,
            "ttft_s": (first - started) if first is not None else None,
            "kv_transfer_s": metrics.kv_transfer_s if metrics else 0.0,
            "kv_blocks_received": metrics.kv_blocks_received if metrics else 0,
            "kv_bytes_received": metrics.kv_bytes_received if metrics else 0,
            "num_recomputed_tokens": metrics.num_recomputed_tokens if metrics else 0,
        }

    def _error(
        self, status: int, message: str, kind: str, param: str | None = None
    ) -> web.Response:
        self.metrics.finished(status, None, None)
        return web.json_response(error_body(message, kind, param), status=status)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
