"""A request on a fleet of vLLM servers: the client's body, checked only for what the P/D flow
needs (`check_vllm_body`), and what the flow carries along (`VllmCall`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvtransfer.router.openai.requests import InvalidRequest
from kvtransfer.router.routing.disagg import RouteDecision
from kvtransfer.router.routing.policy import RouteContext

if TYPE_CHECKING:
    from kvtransfer.router.flow_rules import SloOutcome


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
    # P/D or one instance alone, and why (`routing.disagg.decide`); None until decided.
    decision: RouteDecision | None = None
    outcome: SloOutcome | None = None

    @property
    def path(self) -> str:
        return self.request.path
