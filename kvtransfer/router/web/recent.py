"""`RecentRequests`: the last requests this router answered, for the fleet page (`fleet_page`).

Every request to ``/v1/completions`` or ``/v1/chat/completions`` that ends, whatever its status,
becomes one `RequestSummary`: its id, arrival, model, HTTP status (with the message of the
error it ended with: see `errors.FailedAnswer`), whether its stream failed after its first
bytes, and per choice a `ChoiceSummary` read from the choice's ``kvtransfer`` object: its route
(the prefill and decode instances, or a decode alone), whether its KV was streamed, how many
picks were retries, TTFT, tokens and the timeline rows.

Bounded in size, not only in count, since daemons write the timeline's attributes and clients
the text errors echo: the ring holds ``capacity`` requests (the oldest dropped); only the newest
`DETAILED_REQUESTS` keep their timeline rows (the others keep their counts); a request keeps at
most `MAX_TIMELINE_ROWS` rows and `MAX_TIMELINE_CHARS` of them over all its choices (a long
decode records a span per step; the rest are counted in ``timeline_rows_dropped``); each row is
stored sanitised (`timeline_row`: scalar attributes only, strings cut, no NaN, which the
browser's JSON parser refuses); an error's message is cut to `MAX_ERROR_CHARS`. A choice that
ended waits for its request's status (`choice_ended`, then `finished`); every request reaches
`finished` (the handler's ``finally``), so what waits is at most the requests in flight.

The bookkeeping runs inside the request handlers and must never fail a request: the callers
guard each call, and `HookFailures` logs what went wrong once (then at debug).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from aiohttp import web

from kvtransfer.router.daemon_flow.exchange import Delta
from kvtransfer.router.echo import clipped
from kvtransfer.router.errors import FAILED_ANSWER, FailedAnswer

logger = logging.getLogger("kvtransfer.router.dashboard")

# What the fleet page lists.
RECENT_REQUESTS = 50
# The newest requests whose timeline rows are kept (the page draws one at a time, the newest
# unless another is clicked).
DETAILED_REQUESTS = 10
# Over all the choices of one request: a 1000-token decode alone records ~1500 spans; the page
# draws no more than a screen's width of bars anyway.
MAX_TIMELINE_ROWS = 1024
# And of their size in JSON characters (`row_chars`, from above): with `DETAILED_REQUESTS`, the
# ring holds a few MiB of timelines at most, whatever the daemons write.
MAX_TIMELINE_CHARS = 256 * 1024
MAX_ERROR_CHARS = 256
# A row as stored: its name, and at most this many attributes, keys and strings cut.
MAX_NAME_CHARS = 128
MAX_ATTRIBUTES = 8
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 128
# An integer past 64 bits is no span's measure (and one of 5000 digits does not even print).
_INT_LIMIT = 2**63


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

    def without_timeline(self) -> ChoiceSummary:
        dropped = len(self.timeline) + self.timeline_rows_dropped
        return replace(self, timeline=(), timeline_rows_dropped=dropped)


@dataclass(frozen=True)
class RequestSummary:
    """One HTTP request as it ended."""

    request_id: str
    path: str
    arrived_unix_ms: float
    model: str
    status: int
    duration_ms: float
    # The message of the error it ended with (None: none), at most `MAX_ERROR_CHARS`.
    error: str | None
    choices: tuple[ChoiceSummary, ...] = ()
    # Its stream failed after its first bytes: the status (200) went out before the error.
    stream_failed: bool = False
    # False once newer requests took its place among the `DETAILED_REQUESTS`.
    timelines_kept: bool = True

    def brief(self) -> dict[str, Any]:
        return self._json([choice.brief() for choice in self.choices])

    def detail(self) -> dict[str, Any]:
        return self._json([choice.detail() for choice in self.choices])

    @cached_property
    def detail_json(self) -> bytes:
        """`detail` serialised, once: the page asks for the newest request's at every change."""
        return json.dumps(self.detail(), allow_nan=False).encode()

    def without_timelines(self) -> RequestSummary:
        choices = tuple(choice.without_timeline() for choice in self.choices)
        return replace(self, choices=choices, timelines_kept=False)

    def _json(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "path": self.path,
            "arrived_unix_ms": self.arrived_unix_ms,
            "model": self.model,
            "status": self.status,
            "duration_ms": self.duration_ms,
            "error": self.error,
            "stream_failed": self.stream_failed,
            "timelines_kept": self.timelines_kept,
            # The first choice's: several choices mostly share one prompt (``n``).
            "prompt_tokens": self.choices[0].prompt_tokens if self.choices else None,
            "completion_tokens": sum(c.completion_tokens for c in self.choices),
            "choices": choices,
        }


@dataclass
class _Pending:
    choices: list[ChoiceSummary] = field(default_factory=list)
    rows_left: int = MAX_TIMELINE_ROWS
    chars_left: int = MAX_TIMELINE_CHARS


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
        choice = choice_summary(delta, pending.rows_left, pending.chars_left)
        pending.rows_left -= len(choice.timeline)
        pending.chars_left -= sum(map(row_chars, choice.timeline))
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
        *,
        stream_failed: bool = False,
    ) -> RequestSummary:
        pending = self._pending.pop(request_id, None)
        choices = () if pending is None else tuple(sorted(pending.choices, key=lambda c: c.index))
        summary = RequestSummary(
            request_id,
            path,
            arrived_unix_ms,
            model,
            status,
            duration_ms,
            None if error is None else clipped(error, MAX_ERROR_CHARS),
            choices,
            stream_failed,
        )
        self._done.append(summary)
        older = len(self._done) - 1 - DETAILED_REQUESTS
        if older >= 0 and self._done[older].timelines_kept:
            self._done[older] = self._done[older].without_timelines()
        return summary

    @property
    def in_flight(self) -> int:
        """Requests with an ended choice and no status yet."""
        return len(self._pending)

    def newest_first(self) -> list[RequestSummary]:
        return list(reversed(self._done))

    def get(self, request_id: str) -> RequestSummary | None:
        return next((s for s in self._done if s.request_id == request_id), None)


class HookFailures:
    """A bookkeeping hook that raised, logged so that the request goes on: the first failure
    with its traceback, the later ones at debug (one per request would flood the log)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.count = 0

    def record(self) -> None:
        """Call from the ``except`` block that caught the failure."""
        self.count += 1
        level = logging.WARNING if self.count == 1 else logging.DEBUG
        logger.log(
            level,
            "fleet page: %s failed (%d so far; the request goes on, later failures are logged "
            "at debug)",
            self.hook,
            self.count,
            exc_info=True,
        )


def choice_summary(
    delta: Delta, max_rows: int = MAX_TIMELINE_ROWS, max_chars: int = MAX_TIMELINE_CHARS
) -> ChoiceSummary:
    """A choice's summary from its last delta, keeping at most ``max_rows`` timeline rows and
    ``max_chars`` of them (each sanitised: `timeline_row`)."""
    info = delta.info or {}
    given = info.get("timeline") or ()
    rows: Sequence[Any] = given if isinstance(given, list | tuple) else ()
    clean = [r for r in map(timeline_row, rows) if r is not None]
    picks = [row for row in clean if row["name"] == "router.pick"]
    roles = {_attribute(row, "role") for row in picks}
    calls = [row for row in clean if row["name"] == "router.prefill_call"]
    streamed = _attribute(calls[-1], "kv_stream") if calls else None
    ttft_s = info.get("ttft_s")
    kept: list[dict[str, Any]] = []
    chars = 0
    for row in clean[: max(0, max_rows)]:
        chars += row_chars(row)
        if chars > max_chars:
            break
        kept.append(row)
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
        timeline=tuple(kept),
        timeline_rows_dropped=len(rows) - len(kept),
    )


def timeline_row(row: object) -> dict[str, Any] | None:
    """A timeline row as the ring keeps it, or None when it is not one (no name, a time that
    is not a finite number): its name and times, and at most `MAX_ATTRIBUTES` attributes whose
    values are scalars (strings cut to `MAX_VALUE_CHARS`; any other value, a NaN or an
    infinity, None)."""
    if not isinstance(row, Mapping):
        return None
    name, start, duration = row.get("name"), row.get("start_ms"), row.get("duration_ms")
    if not isinstance(name, str) or not (_finite(start) and _finite(duration)):
        return None
    kept: dict[str, Any] = {
        "name": clipped(name, MAX_NAME_CHARS),
        "start_ms": start,
        "duration_ms": duration,
    }
    attributes = row.get("attributes")
    if isinstance(attributes, Mapping) and attributes:
        items = itertools.islice(attributes.items(), MAX_ATTRIBUTES)
        kept["attributes"] = {clipped(str(k), MAX_KEY_CHARS): _scalar(v) for k, v in items}
    return kept


def row_chars(row: Mapping[str, Any]) -> int:
    """The JSON characters of a `timeline_row` in a list, at most (numbers counted as their
    longest; punctuation, its times and the separator after it in the constant)."""
    size = 112 + _json_chars(row["name"])
    for key, value in (row.get("attributes") or {}).items():
        size += 4 + _json_chars(key) + (_json_chars(value) if isinstance(value, str) else 24)
    return size


def _json_chars(text: str) -> int:
    if text.isascii() and text.isprintable():  # escaped: only quotes and backslashes
        return len(text) + 2 + text.count('"') + text.count("\\")
    return len(json.dumps(text))


def answer_failure(response: web.StreamResponse | None) -> FailedAnswer | None:
    """What the answer records of its failure (None: it did not fail, or there is no answer:
    the handler raised)."""
    return None if response is None else response.get(FAILED_ANSWER)


def _finite(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -_INT_LIMIT <= value < _INT_LIMIT
    return isinstance(value, float) and math.isfinite(value)


def _scalar(value: object) -> str | int | float | bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -_INT_LIMIT <= value < _INT_LIMIT else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return clipped(value, MAX_VALUE_CHARS)
    return None


def _attribute(row: Mapping[str, Any], name: str) -> Any:
    attributes = row.get("attributes")
    return attributes.get(name) if isinstance(attributes, Mapping) else None
