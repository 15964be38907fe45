"""The router's upstream failures: what went wrong on a daemon, as the HTTP status to answer.

The table of statuses is in `kvtransfer.router.daemon_flow.upstream`; `retryable` says which
failures another instance may be asked to redo. An answer that failed carries a `FailedAnswer`
(under `FAILED_ANSWER`) for the router's record of it (the fleet page's last requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

# The reason of a failure that ran out of the request's time (gRPC's status name).
TIMEOUT = "DEADLINE_EXCEEDED"
# A deadline is the request's whole budget: a retry would only hit it again.
_NOT_RETRYABLE_REASONS = frozenset({TIMEOUT})


class UpstreamError(RuntimeError):
    """A daemon failed the request: ``status`` is the HTTP status to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        role: str,
        address: str,
        reason: str = "error",
        *,
        text: str | None = None,
    ) -> None:
        super().__init__(text or f"{role} daemon {address}: {message}")
        self.status = status
        self.message = message
        self.role = role
        self.address = address
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """Whether another instance of the role may succeed where this one failed: a 5xx of
        the daemon's own (not a refusal of the input, not the request's deadline)."""
        return self.status >= 500 and self.reason not in _NOT_RETRYABLE_REASONS


class NoHealthyDaemon(UpstreamError):
    """No daemon of ``role`` may be picked: 503 at once, naming each daemon and its state (or
    saying the role has none yet, while DNS or the admin API will add them)."""

    def __init__(self, role: str, states: Mapping[str, str]) -> None:
        if states:
            listed = "; ".join(f"{address}: {state}" for address, state in states.items())
            message = f"no {role} daemon is healthy ({listed})"
        else:
            message = f"no {role} daemon is healthy (the fleet has no {role} daemon yet)"
        super().__init__(503, message, role, ", ".join(states), "no_healthy_daemon", text=message)

    @property
    def retryable(self) -> bool:
        return False


class ClientGone(Exception):
    """The client closed the connection while its stream was being written."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


@dataclass(frozen=True)
class FailedAnswer:
    """What the router records of an answer that failed, in words of its own: the message of
    an error body it wrote; for an answer passed through from a vLLM server, who refused and
    the status, never the body (the server's text, up to megabytes); for a stream that failed
    after its first bytes (its status 200 already sent), the error event's message."""

    message: str
    mid_stream: bool = False


FAILED_ANSWER = web.ResponseKey("kvtransfer_failed_answer", FailedAnswer)
