"""A request's timeline: named spans recorded where the work happens, collected by request id.

Any layer records into the process-wide `BOOK` (the router, a daemon's gRPC handlers, the
engine's scheduler, a connector's loader thread) under the request's id; whoever answers the
request `take`\\ s its spans at the end and ships them on (a daemon in its final gRPC message,
the router in the answer's ``kvtransfer`` object and to OpenTelemetry, `kvtransfer.router.tracing`).

Times are wall-clock nanoseconds since the epoch (``time.time_ns``) so that spans recorded by
several processes line up on one time axis; on one host they are exact, across hosts they are
as good as the hosts' clock sync. Durations measured with ``time.monotonic`` are converted with
`wall_ns`.

Recording must never cost a request anything it would notice: a span is one small object and a
dict append under a lock, the book keeps at most ``max_requests`` requests (the oldest are
dropped: a request nobody took the spans of, e.g. one that failed before answering) and at most
``max_spans`` spans per request (later ones are counted in ``dropped``, not kept).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

AttributeValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class Span:
    """One named interval of one request. ``process`` says which program recorded it
    (``router``, ``prefill``, ``decode``; set when the spans leave their process)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    process: str = ""

    @property
    def duration_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9

    def qualified_name(self) -> str:
        """``process.name`` (``prefill.engine.compute``), or the bare name with no process."""
        return f"{self.process}.{self.name}" if self.process else self.name


def now_ns() -> int:
    return time.time_ns()


def wall_ns(monotonic_s: float) -> int:
    """The wall-clock instant (ns) of a ``time.monotonic()`` reading taken in this process."""
    return wall_clock()(monotonic_s)


def wall_clock() -> Callable[[float], int]:
    """A converter of ``time.monotonic()`` readings to wall-clock ns, anchored on one pair of
    clock reads: instants converted through the same converter keep their order and gaps
    (two `wall_ns` calls may not, as each pairs the clocks anew, some hundred ns apart)."""
    anchor_wall = time.time_ns()
    anchor_monotonic = time.monotonic()
    return lambda monotonic_s: anchor_wall - int((anchor_monotonic - monotonic_s) * 1e9)


class TimelineBook:
    """Spans per request id, bounded (see the module docstring); safe from any thread."""

    def __init__(self, max_requests: int = 4096, max_spans: int = 512) -> None:
        if max_requests < 1 or max_spans < 1:
            raise ValueError(
                f"max_requests and max_spans must be >= 1, got {max_requests}, {max_spans}"
            )
        self.max_requests = max_requests
        self.max_spans = max_spans
        self.dropped = 0
        self._spans: OrderedDict[str, list[Span]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, request_id: str, span: Span) -> None:
        self.add_many((request_id,), span)

    def add_many(self, request_ids: Iterable[str], span: Span) -> None:
        """Record one span for several requests (a batched step's layer serves them all)."""
        with self._lock:
            for request_id in request_ids:
                spans = self._spans.get(request_id)
                if spans is None:
                    spans = self._spans[request_id] = []
                    while len(self._spans) > self.max_requests:
                        self._spans.popitem(last=False)
                        self.dropped += 1
                if len(spans) < self.max_spans:
                    spans.append(span)
                else:
                    self.dropped += 1

    def record(
        self, request_id: str, name: str, start_ns: int, end_ns: int, **attributes: AttributeValue
    ) -> None:
        self.add(request_id, Span(name, start_ns, end_ns, attributes))

    @contextmanager
    def span(self, request_id: str, name: str, **attributes: AttributeValue) -> Iterator[None]:
        """Records ``name`` around the block, also when it raises (``error`` is then set)."""
        start = now_ns()
        try:
            yield
        except BaseException as exc:
            attributes["error"] = type(exc).__name__
            raise
        finally:
            self.record(request_id, name, start, now_ns(), **attributes)

    def take(self, request_id: str) -> list[Span]:
        """The request's spans in start order, forgotten here."""
        with self._lock:
            spans = self._spans.pop(request_id, [])
        return sorted(spans, key=lambda s: s.start_ns)

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)


# The process's book: every recorder writes here, every answering layer takes from here.
BOOK = TimelineBook()


def relative(spans: Iterable[Span], origin_ns: int) -> list[dict[str, object]]:
    """Spans as JSON-ready rows in ms from ``origin_ns`` (the request's arrival at the router):
    what the ``kvtransfer.timeline`` field of an answer holds."""
    rows: list[dict[str, object]] = []
    for span in sorted(spans, key=lambda s: s.start_ns):
        row: dict[str, object] = {
            "name": span.qualified_name(),
            "start_ms": round((span.start_ns - origin_ns) / 1e6, 3),
            "duration_ms": round((span.end_ns - span.start_ns) / 1e6, 3),
        }
        if span.attributes:
            row["attributes"] = dict(span.attributes)
        rows.append(row)
    return rows
