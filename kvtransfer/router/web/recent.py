"""`RecentRequests`: the last requests this router answered, for the fleet page (`fleet_page`).

Every request to ``/v1/completions`` or ``/v1/chat/completions`` that ends, whatever its status,
becomes one `RequestSummary`: its id, arrival, model, HTTP status (with the error's message
when the router answered one), and per choice a `ChoiceSummary` read from the choice's
``kvtransfer`` object: its route (the prefill and decode instances, or a decode alone), whether
its KV was streamed, how many picks were retries, TTFT, tokens and the timeline rows.

Bounded twice: the ring holds ``capacity`` requests (the oldest dropped), and a request keeps
at most `MAX_TIMELINE_ROWS` timeline rows over all its choices (a long decode records a span
per step; the rest are counted in ``timeline_rows_dropped``). A choice that ended waits for its
request's status (`choice_ended`, then `finished`); every request reaches `finished` (the
handler's ``finally``), so what waits is at most the requests in flight.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvtransfer.router.daemon_flow.exchange import Delta

# What the fleet page lists.
RECENT_REQUESTS = 50
# Over all the choices of one request: a 1000-token decode alone records ~1500 spans.
MAX_TIMELINE_ROWS = 4096


@dataclass(frozen=True)
class ChoiceSummary:
    """One choice as its answer's ``kvtransfer`` object tells it."""

    request_id: str
    index: int
    prefill: str | None
    decode: str | None
    # Whether the prefill announced its KV while computing it (None: no prefill call).
    kv_stream: bool | None
    # Picks beyond the first of each role: another instance after a failure that sent nothing.
    retries: int
    ttft_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    kv_blocks_received: int
    timeline: tuple[Mapping[str, Any], ...] = ()
    timeline_rows_dropped: int = 0

    def brief(self) -> dict[str, Any]:
        """Everything but the timeline's rows (their count instead)."""
        return {
            "request_id": self.request_id,
            "index": self.index,
            "prefill": self.prefill,
            "decode": self.decode,
            "kv_stream": self.kv_stream,
            "retries": self.retries,
            "ttft_ms": self.ttft_ms,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "kv_blocks_received": self.kv_blocks_received,
            "timeline_spans": len(self.timeline) + self.timeline_rows_dropped,
        }

    def detail(self) -> dict[str, Any]:
        return {
            **self.brief(),
            "timeline": list(self.timeline),
            "timeline_rows_dropped": self.timeline_rows_dropped,
        }


@dataclass(frozen=True)
class RequestSummary:
    """One HTTP request as it ended."""

    request_id: str
    path: str
    arrived_unix_ms: float
    model: str
    status: int
    duration_ms: float
    # The message of the error the router answered (None: it answered no error body).
    error: str | None
    choices: tuple[ChoiceSummary, ...] = ()

    def brief(self) -> dict[str, Any]:
        return self._json([choice.brief() for choice in self.choices])

    def detail(self) -> dict[str, Any]:
        return self._json([choice.detail() for choice in self.choices])

    def _json(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "path": self.path,
            "arrived_unix_ms": self.arrived_unix_ms,
            "model": self.model,
            "status": self.status,
            "duration_ms": self.duration_ms,
            "error": self.error,
            # The first choice's: several choices mostly share one prompt (``n``).
            "prompt_tokens": self.choices[0].prompt_tokens if self.choices else None,
            "completion_tokens": sum(c.completion_tokens for c in self.choices),
            "choices": choices,
        }


@dataclass
class _Pending:
    choices: list[ChoiceSummary] = field(default_factory=list)
    rows_left: int = MAX_TIMELINE_ROWS


class RecentRequests:
    """The last ``capacity`` requests, newest last; fed by the router's handlers."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._done: deque[RequestSummary] = deque(maxlen=capacity)
        self._pending: dict[str, _Pending] = {}

    def choice_ended(self, request_id: str, delta: Delta) -> None:
        """The last delta of one choice of the HTTP request ``request_id`` (its ``info``
        carries the ``kvtransfer`` object)."""
        if delta.info is None:
            return
        pending = self._pending.setdefault(request_id, _Pending())
        choice = choice_summary(delta, pending.rows_left)
        pending.rows_left -= len(choice.timeline)
        pending.choices.append(choice)

    def finished(
        self,
        request_id: str,
        path: str,
        arrived_unix_ms: float,
        model: str,
        status: int,
        duration_ms: float,
        error: str | None = None,
    ) -> RequestSummary:
        pending = self._pending.pop(request_id, None)
        choices = () if pending is None else tuple(sorted(pending.choices, key=lambda c: c.index))
        summary = RequestSummary(
            request_id, path, arrived_unix_ms, model, status, duration_ms, error, choices
        )
        self._done.append(summary)
        return summary

    @property
    def in_flight(self) -> int:
        """Requests with an ended choice and no status yet."""
        return len(self._pending)

    def newest_first(self) -> list[RequestSummary]:
        return list(reversed(self._done))

    def get(self, request_id: str) -> RequestSummary | None:
        return next((s for s in self._done if s.request_id == request_id), None)


def choice_summary(delta: Delta, max_rows: int = MAX_TIMELINE_ROWS) -> ChoiceSummary:
    """A choice's summary from its last delta, keeping at most ``max_rows`` timeline rows."""
    info = delta.info or {}
    rows: Sequence[Mapping[str, Any]] = info.get("timeline") or ()
    picks = [row for row in rows if row.get("name") == "router.pick"]
    roles = {_attribute(row, "role") for row in picks}
    calls = [row for row in rows if row.get("name") == "router.prefill_call"]
    streamed = _attribute(calls[-1], "kv_stream") if calls else None
    ttft_s = info.get("ttft_s")
    kept = tuple(rows[: max(0, max_rows)])
    return ChoiceSummary(
        request_id=str(info.get("request_id", "")),
        index=delta.index,
        prefill=info.get("prefill"),
        decode=info.get("decode"),
        kv_stream=streamed if isinstance(streamed, bool) else None,
        retries=len(picks) - len(roles),
        ttft_ms=None if ttft_s is None else round(ttft_s * 1e3, 3),
        prompt_tokens=delta.num_prompt_tokens,
        completion_tokens=len(info.get("token_ids") or ()),
        kv_blocks_received=int(info.get("kv_blocks_received") or 0),
        timeline=kept,
        timeline_rows_dropped=len(rows) - len(kept),
    )


def error_message(response: web.StreamResponse | None) -> str | None:
    """The ``error.message`` of an error answer in OpenAI's shape (None: not one)."""
    if not isinstance(response, web.Response) or response.status < 400:
        return None
    body = response.body
    if not isinstance(body, bytes):
        return None
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) else None


def _attribute(row: Mapping[str, Any], name: str) -> Any:
    attributes = row.get("attributes")
    return attributes.get(name) if isinstance(attributes, Mapping) else None
