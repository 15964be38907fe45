"""What goes wrong with a vLLM server's answer, as typed `UpstreamError` s naming the instance:
each says whether it counts against the instance's breaker and whether another instance is
worth trying."""

from __future__ import annotations

import contextlib
import json

from kvtransfer.router.errors import TIMEOUT, UpstreamError
from kvtransfer.router.fleet.instance import Instance

MESSAGE_CHARS = 300


def unusable_answer(instance: Instance, why: str) -> UpstreamError:
    """A 200 answer that is not vLLM's: the instance's fault, worth another one."""
    instance.failed()
    return UpstreamError(
        502, f"its answer is unusable: {why}", instance.role, instance.address, "bad_answer"
    )


def vllm_error(instance: Instance, status: int, raw: bytes) -> UpstreamError:
    """A 5xx of vLLM's own, or a status vLLM does not answer (a redirect): 502, counted on its
    breaker, worth another instance."""
    instance.failed()
    message: object = raw.decode(errors="replace").strip() or "(empty body)"
    # RecursionError: a body nested deeper than the parser goes.
    with contextlib.suppress(ValueError, KeyError, TypeError, RecursionError):
        message = json.loads(raw)["error"]["message"]
    text = str(message)
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "..."
    return UpstreamError(
        502, f"HTTP {status}: {text}", instance.role, instance.address, f"http_{status}"
    )


class AnswerTooLarge(UpstreamError):
    """An answer over the router's bound: another instance would answer as much."""

    @property
    def retryable(self) -> bool:
        return False


def cut_error(instance: Instance, exc: BaseException) -> UpstreamError:
    detail = str(exc) or type(exc).__name__
    return UpstreamError(
        502, f"its answer was cut: {detail}", instance.role, instance.address, "cut"
    )


def truncated_error(instance: Instance) -> UpstreamError:
    message = "its stream ended without vLLM's last event (data: [DONE])"
    return UpstreamError(502, message, instance.role, instance.address, "truncated")


def deadline_error(instance: Instance) -> UpstreamError:
    return UpstreamError(
        503,
        "no answer within the request deadline (--request-timeout-s)",
        instance.role,
        instance.address,
        TIMEOUT,
    )
