"""A picture of one request's handover: its timeline (`kvtransfer.timeline`) drawn as swimlanes.

The input is what the router answers: the ``kvtransfer`` object of a completion (top level, in
a choice, or in a streamed chunk) with its ``timeline`` rows (``name`` as ``process.span``,
``start_ms`` and ``duration_ms`` from the request's arrival at the router). The picture has one
lane per party, router, prefill, KV and decode, and in each lane as many rows as its spans need
not to overlap; a span is one bar (its SVG element's id is ``name.N``, the N-th of that name),
a token handed on a marker. The router's TTFT (the answer's ``ttft_s``) is a vertical line.
A span reaching outside the axes (before the request's arrival: another host's clock) is cut
at their edge; one wholly outside is left out.

Answers are read as untrusted: every time must be a finite number within `MAX_MS`, text is
drawn as it is (a ``$`` is not mathtext), a timeline of more than `MAX_ROWS` rows or
`MAX_LANES` lanes is refused; anything that cannot be drawn is a `TimelineError` naming what.

matplotlib is imported only when drawing, with its Agg canvas (no display, no global backend
switched), so that reading answers costs nothing to a process that never draws.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtransfer.timeline import AttributeValue

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Pixels: 12 x 6.4 inches at 100 dpi. Fixed, so that pictures of requests compare side by side.
WIDTH_IN, HEIGHT_IN, DPI = 12.0, 6.4, 100
PNG_SIZE_PX = (int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))
# A request's timeline holds at most 512 rows from each process on its path (the timeline
# book's limit): more is a broken or hostile answer, and would take matplotlib minutes to draw.
MAX_ROWS = 4096
# A lane per process: router, prefill, KV, decode, and one per other process named. More than
# this do not fit the picture's height, and each costs matplotlib a tick label to lay out.
MAX_LANES = 64
# Times (ms from the request's arrival) lie within this of 0, about 32 years: no request's
# timeline comes near, and matplotlib's axes fail on ranges near float's limits.
MAX_MS = 1e12


class TimelineError(ValueError):
    """An answer or a timeline that cannot be drawn; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """One span of the answer's timeline, in ms from the request's arrival at the router."""

    name: str
    start_ms: float
    duration_ms: float
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)

    @property
    def end_ms(self) -> float:
        return self.start_ms + self.duration_ms

    @property
    def process(self) -> str:
        return self.name.partition(".")[0]


@dataclass(frozen=True, slots=True)
class Handover:
    """What the picture shows of one request."""

    request_id: str
    rows: tuple[TimelineRow, ...]
    kv_bytes: int = 0
    # TTFT as the router measured it (its answer's ttft_s), in ms from the same origin.
    ttft_ms: float | None = None

    def named(self, name: str) -> list[TimelineRow]:
        return [row for row in self.rows if row.name == name]

    @property
    def prompt_tokens(self) -> int | None:
        """As the engine that computed the prompt counted them."""
        for name in ("prefill.engine.compute", "decode.engine.compute"):
            for row in self.named(name):
                value = row.attributes.get("prompt_tokens")
                if isinstance(value, int):
                    return value
        return None


# ------------------------------------------------------------------ reading answers


def read_answer(text: str) -> list[dict[str, Any]]:
    """The ``kvtransfer`` objects in a saved answer: one JSON document (an answer, a chunk, a
    list of them, or the object itself) or a stream as sent (``data: {...}`` lines)."""
    try:
        document: Any = _loads(text)
    except json.JSONDecodeError as exc:
        chunks = [
            line.removeprefix("data: ")
            for line in text.splitlines()
            if line.startswith("data: ") and line.strip() != "data: [DONE]"
        ]
        if not chunks:
            raise TimelineError(
                f"not a JSON answer nor a stream of 'data: ' lines ({exc.msg} at line "
                f"{exc.lineno} column {exc.colno})"
            ) from None
        try:
            document = [_loads(chunk) for chunk in chunks]
        except json.JSONDecodeError as chunk_exc:
            raise TimelineError(f"a streamed chunk is not JSON: {chunk_exc.msg}") from None
    return list(_infos(document))


def _loads(text: str) -> Any:
    """JSON, with what the parser refuses past its syntax as a TimelineError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise TimelineError("the answer is nested too deeply to read") from None
    except ValueError:
        # The only other refusal of json.loads: an integer of more digits than Python
        # converts (sys.get_int_max_str_digits).
        raise TimelineError(
            f"the answer holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None


def _infos(document: Any) -> Iterable[dict[str, Any]]:
    # Lists within lists are walked with a stack of iterators, not by recursion: a document
    # the parser could read nests no deeper than this walk can go.
    stack = [iter((document,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        elif isinstance(item, dict):
            yield from _infos_of(item)


_END = object()


def _infos_of(document: dict[str, Any]) -> Iterable[dict[str, Any]]:
    if "timeline" in document:
        yield document
        return
    if isinstance(document.get("kvtransfer"), dict):
        yield document["kvtransfer"]
    for choice in document.get("choices") or ():
        if isinstance(choice, dict) and isinstance(choice.get("kvtransfer"), dict):
            yield choice["kvtransfer"]


def handover(infos: Sequence[Mapping[str, Any]], request_id: str | None = None) -> Handover:
    """The request ``request_id`` (or the only one) of ``kvtransfer`` objects, checked."""
    timed = [info for info in infos if "timeline" in info]
    if not timed:
        raise TimelineError(
            "the answer has no kvtransfer timeline (a router answer's kvtransfer object "
            "carries one)"
        )
    ids = list(dict.fromkeys(str(info.get("request_id", "")) for info in timed))
    if request_id is not None:
        chosen = [info for info in timed if info.get("request_id") == request_id]
        if not chosen:
            raise TimelineError(
                f"request id {request_id!r} is not in the answer (it has {', '.join(ids)})"
            )
    elif len(ids) > 1:
        raise TimelineError(f"the answer has {len(ids)} requests ({', '.join(ids)}): name one")
    else:
        chosen = timed
    info = chosen[-1]  # a stream repeats it: the last chunk's is the complete one
    rid = _text(str(info.get("request_id", "")), "request id")
    rows = tuple(_row(rid, index, raw) for index, raw in enumerate(_rows_of(rid, info)))
    reads = sum(_int(row.attributes.get("bytes")) for row in rows if row.name == "decode.kv.read")
    return Handover(
        request_id=rid,
        rows=rows,
        kv_bytes=_int(info.get("kv_bytes_received")) or reads,
        ttft_ms=_ttft_ms(rid, info.get("ttft_s")),
    )


def _ttft_ms(rid: str, ttft_s: Any) -> float | None:
    if ttft_s is None:  # the router found no first token
        return None
    seconds = _finite(ttft_s)
    if seconds is None or not 0 <= seconds * 1e3 <= MAX_MS:
        raise TimelineError(
            f"request {rid!r}: ttft_s must be a number from 0 to {MAX_MS / 1e3:g}, got "
            f"{_brief(ttft_s)}"
        )
    return seconds * 1e3


def _rows_of(rid: str, info: Mapping[str, Any]) -> list[Any]:
    rows = info["timeline"]
    if not isinstance(rows, list):
        raise TimelineError(f"request {rid!r}: timeline must be a list, got {type(rows).__name__}")
    if not rows:
        raise TimelineError(f"request {rid!r} has an empty timeline: nothing to draw")
    if len(rows) > MAX_ROWS:
        raise TimelineError(
            f"request {rid!r} has {len(rows)} timeline rows: more than {MAX_ROWS} are not drawn"
        )
    return rows


def _row(rid: str, index: int, raw: Any) -> TimelineRow:
    where = f"request {rid!r}: timeline row {index}"
    if not isinstance(raw, dict):
        raise TimelineError(f"{where} must be an object, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TimelineError(f"{where}: name must be a non-empty string, got {_brief(name)}")
    name = _text(name, f"{where}: name")
    numbers = {}
    for key in ("start_ms", "duration_ms"):
        value = raw.get(key)
        number = _finite(value)
        if number is None:
            raise TimelineError(
                f"{where} ({name}): {key} must be a finite number, got {_brief(value)}"
            )
        numbers[key] = number
    if numbers["duration_ms"] < 0:
        raise TimelineError(f"{where} ({name}): duration_ms must be >= 0, got {raw['duration_ms']}")
    start, end = numbers["start_ms"], numbers["start_ms"] + numbers["duration_ms"]
    if not -MAX_MS <= start <= end <= MAX_MS:  # an end past float's range is inf
        raise TimelineError(
            f"{where} ({name}): start_ms and its end (start_ms + duration_ms) must lie within "
            f"±{MAX_MS:g} ms, got {start!r} and {end!r}"
        )
    attributes = raw.get("attributes") or {}
    if not isinstance(attributes, dict):
        raise TimelineError(f"{where} ({name}): attributes must be an object")
    for key, value in attributes.items():
        if isinstance(value, str):
            _text(value, f"{where} ({name}): attribute {key!r}")
    return TimelineRow(name, numbers["start_ms"], numbers["duration_ms"], attributes)


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        return None
    return number if math.isfinite(number) else None


def _text(value: str, what: str) -> str:
    # JSON's \ud800 escapes give str that no font draws and no file encodes.
    try:
        value.encode()
    except UnicodeEncodeError:
        raise TimelineError(
            f"{what} is not Unicode text (a lone surrogate): {_brief(value)}"
        ) from None
    return value


def _brief(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _int(value: Any) -> int:
    # Byte counts: an unsigned 64-bit int as the daemons send; anything else is not drawn.
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return value
    return 0


# ------------------------------------------------------------------ drawing

# Lanes top to bottom, the spans each holds in the order they are placed in its rows; a span
# named nowhere goes to its process's lane (its own lane for an unknown process).
LANES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "router",
        (
            "router.parse",
            "router.tokenize",
            "router.admit",
            "router.pick",
            "router.prefill_call",
            "router.first_token_out",
            "router.decode_call",
            "router.decode_first_message",
        ),
    ),
    (
        "prefill",
        (
            "prefill.admit",
            "prefill.model.layer",
            "prefill.first_token_out",
            "prefill.engine.queue",
            "prefill.engine.compute",
        ),
    ),
    (
        "KV",
        (
            "prefill.kv.save_layer",
            "decode.kv.handshake",
            "decode.kv.read",
            "decode.kv.keys",
        ),
    ),
    (
        "decode",
        (
            "decode.admit",
            "decode.engine.kv_wait",
            "decode.kv.wait_layer",
            "decode.model.layer",
            "decode.engine.compute",
            "decode.first_token_out",
            "decode.engine.step",
            "decode.engine.queue",
        ),
    ),
)
_LANE_OF_PROCESS = {"router": "router", "prefill": "prefill", "decode": "decode"}


@dataclass(frozen=True, slots=True)
class _Phase:
    label: str
    color: str
    # Alternate shade for consecutive spans of one name (layers, steps), so each shows.
    other: str | None = None


_ROUTER = _Phase("router: parse, tokenize, admit, pick", "#8d99a6")
_CALL = _Phase("router's gRPC call to a daemon", "#dfe6ee")
_ADMIT = _Phase("daemon admits, engine queue", "#c9c9c9")
_PREFILL = _Phase("prefill computes the prompt", "#fbd3a6")
_LAYER = _Phase("a layer computed", "#e8743b", "#f3a46f")
_SAVE = _Phase("a layer's KV saved for decode", "#2ca02c")
_CONNECT = _Phase("handshake, one-sided keys", "#9467bd")
_READ = _Phase("KV read by decode (one-sided)", "#1f77b4", "#5fa2d6")
_WAIT = _Phase("decode waits for KV", "#e15759")
_DECODE = _Phase("decode's first step", "#2a9d8f")
_STEP = _Phase("decode steps (a token each)", "#7fcdbb", "#a8dccf")
_OTHER = _Phase("other", "#bdbdbd")
_PHASES: dict[str, _Phase] = {
    "router.parse": _ROUTER,
    "router.tokenize": _ROUTER,
    "router.admit": _ROUTER,
    "router.pick": _ROUTER,
    "router.prefill_call": _CALL,
    "router.decode_call": _CALL,
    "router.decode_first_message": _CALL,
    "prefill.admit": _ADMIT,
    "prefill.engine.queue": _ADMIT,
    "decode.admit": _ADMIT,
    "decode.engine.queue": _ADMIT,
    "prefill.engine.compute": _PREFILL,
    "prefill.model.layer": _LAYER,
    "decode.model.layer": _LAYER,
    "prefill.kv.save_layer": _SAVE,
    "decode.kv.handshake": _CONNECT,
    "decode.kv.keys": _CONNECT,
    "decode.kv.read": _READ,
    "decode.engine.kv_wait": _WAIT,
    "decode.kv.wait_layer": _WAIT,
    "prefill.kv.wait_layer": _WAIT,
    "decode.engine.compute": _DECODE,
    "decode.engine.step": _STEP,
}
_LEGEND_ORDER = (
    _ROUTER,
    _CALL,
    _ADMIT,
    _PREFILL,
    _LAYER,
    _SAVE,
    _CONNECT,
    _READ,
    _WAIT,
    _DECODE,
    _STEP,
    _OTHER,
)
_SHORT = {
    "prefill_call": "prefill call",
    "decode_call": "decode call",
    "decode_first_message": "first message",
    "engine.queue": "queue",
    "engine.compute": "compute",
    "engine.kv_wait": "KV wait",
    "kv.handshake": "handshake",
    "kv.keys": "keys",
}
_FIRST_TOKEN = "#b2182b"
_SLACK_MS = 0.002
_LAYER_INDEX = re.compile(r"layers\.(\d+)")


@dataclass(frozen=True, slots=True)
class _Placed:
    row: TimelineRow
    lane: str
    line: int  # row of its lane, 0 at the top
    number: int  # the N-th span of its name


def layout(rows: Sequence[TimelineRow]) -> list[_Placed]:
    """Each span's lane and row in it. Names are placed in their lane's order, all spans of a
    name together in the first row where none of them overlaps anything (so that a request's
    layers, or its steps, read as one row); a name whose spans overlap one another is placed
    span by span."""
    order = {name: (lane, i) for lane, names in LANES for i, name in enumerate(names)}
    lanes = {lane: i for i, (lane, _) in enumerate(LANES)}

    def lane_of(name: str) -> str:
        if name in order:
            return order[name][0]
        process = name.partition(".")[0]
        return _LANE_OF_PROCESS.get(process, process)

    by_name: dict[str, list[TimelineRow]] = {}
    for row in sorted(rows, key=lambda r: r.start_ms):
        by_name.setdefault(row.name, []).append(row)
        lanes.setdefault(lane_of(row.name), len(lanes))

    def rank(name: str) -> tuple[int, int, float]:
        return lanes[lane_of(name)], order.get(name, ("", 99))[1], by_name[name][0].start_ms

    # Markers are drawn over whatever their lane's first row holds at that instant; the other
    # spans take room, in groups that each go to one row. Groups is None for markers.
    plan: list[tuple[str, list[tuple[int, TimelineRow]], list[list[int]] | None]] = []
    for name in sorted(by_name, key=rank):
        lane, spans = lane_of(name), list(enumerate(by_name[name]))
        if _is_marker(spans[0][1]):
            plan.append((lane, spans, None))
            continue
        together = not any(
            _overlap(b, a.start_ms, a.end_ms) for (_, a), (_, b) in itertools.pairwise(spans)
        )
        numbers = range(len(spans))
        plan.append((lane, spans, [list(numbers)] if together else [[i] for i in numbers]))
    in_lane: dict[str, list[TimelineRow]] = {}
    for lane, spans, groups in plan:
        if groups is not None:
            in_lane.setdefault(lane, []).extend(row for _, row in spans)
    rooms = {lane: _LaneRows(lane_rows) for lane, lane_rows in in_lane.items()}

    placed: list[_Placed] = []
    for lane, spans, groups in plan:
        if groups is None:
            placed += [_Placed(row, lane, 0, number) for number, row in spans]
            continue
        for group in groups:
            line = rooms[lane].place([spans[i][1] for i in group])
            placed += [_Placed(spans[i][1], lane, line, i) for i in group]
    return placed


class _LaneRows:
    """The rows of one lane and what each holds: `place` puts spans in the first row where
    none overlaps anything there, in time logarithmic in the lane's spans however many rows
    (first fit by scanning the rows is quadratic: a pile of 20000 alike spans took minutes).

    Overlap is `_overlap`'s, with its very sums: a span overlaps one placed before where its
    open interval (start, end) meets the placed one's narrowed by the slack, (start + slack,
    end - slack). A placed span of at most twice the slack has no such interval: it overlaps
    where the open interval holds all of [end - slack, start + slack]. A row is taken for
    holding one of those within a span when it holds one that begins within it and one that
    ends within it: the same one, but where two of them straddle the span's two ends."""

    def __init__(self, rows: Sequence[TimelineRow]) -> None:
        times = {t for row in rows for t in (row.start_ms, row.end_ms, *_narrowed(row))}
        # Units: 2k is the k-th time, 2k + 1 the open stretch after it.
        self._unit = {t: 2 * k for k, t in enumerate(sorted(times))}
        units = 2 * len(times) - 1
        self._long = _RowSets(units)  # the narrowed open interval of each longer span
        self._short_firsts = _RowSets(units)  # each shorter one's [end - slack, start + slack]
        self._short_lasts = _RowSets(units)

    def place(self, rows: Sequence[TimelineRow]) -> int:
        held = 0
        for row in rows:
            if row.end_ms == row.start_ms:  # an instant: in what holds it
                instant = self._unit[row.start_ms]
                held |= self._long.held(instant, instant)
                continue
            first, last = self._unit[row.start_ms] + 1, self._unit[row.end_ms] - 1
            shorts = self._short_firsts.held(first, last) & self._short_lasts.held(first, last)
            held |= self._long.held(first, last) | shorts
        line = (~held & (held + 1)).bit_length() - 1  # the first row holding none of them
        for row in rows:
            low, high = (self._unit[t] for t in _narrowed(row))
            if low < high:
                self._long.add(low + 1, high - 1, 1 << line)
            else:
                self._short_firsts.add(high, high, 1 << line)
                self._short_lasts.add(low, low, 1 << line)
        return line


def _narrowed(row: TimelineRow) -> tuple[float, float]:
    return row.start_ms + _SLACK_MS, row.end_ms - _SLACK_MS


class _RowSets:
    """For each of ``size`` consecutive units, the set of rows (bits of an int) holding it: a
    segment tree, so that adding rows to a run of units, or asking which rows hold some unit
    of a run, costs a logarithm of ``size`` whatever the run's length."""

    def __init__(self, size: int) -> None:
        self._leaves = 1 << max(size - 1, 0).bit_length()
        self._all = [0] * (2 * self._leaves)  # rows added over the node's whole stretch
        self._any = [0] * (2 * self._leaves)  # rows holding some unit under the node

    def add(self, first: int, last: int, rows: int) -> None:
        for node in self._cover(first, last):
            self._all[node] |= rows
            self._any[node] |= rows
        for leaf in (first + self._leaves, last + self._leaves):
            node = leaf >> 1
            while node:
                self._any[node] |= rows
                node >>= 1

    def held(self, first: int, last: int) -> int:
        """The rows holding some unit from ``first`` to ``last``."""
        found = 0
        # What was added over a stretch holding an end of this run holds a unit of it.
        for leaf in (first + self._leaves, last + self._leaves):
            node = leaf >> 1
            while node:
                found |= self._all[node]
                node >>= 1
        for node in self._cover(first, last):
            found |= self._any[node]
        return found

    def _cover(self, first: int, last: int) -> list[int]:
        """The nodes whose stretches make up the units from ``first`` to ``last``."""
        nodes = []
        low, high = first + self._leaves, last + self._leaves + 1
        while low < high:
            if low & 1:
                nodes.append(low)
                low += 1
            if high & 1:
                high -= 1
                nodes.append(high)
            low >>= 1
            high >>= 1
        return nodes


def _is_marker(row: TimelineRow) -> bool:
    """A token handed on (a µs or two), or anything else of no length: drawn as a marker."""
    return row.duration_ms == 0 or row.name.endswith(".first_token_out")


def _overlap(row: TimelineRow, start_ms: float, end_ms: float) -> bool:
    # Rows are rounded to µs: a span starting where the one before it ended may seem to
    # start a µs earlier.
    return row.start_ms < end_ms - _SLACK_MS and row.end_ms > start_ms + _SLACK_MS


def draw(picture: Handover, png: Path | None = None, svg: Path | None = None) -> list[Path]:
    """Write the picture as PNG and/or SVG; returns the paths written."""
    targets = [(path, kind) for path, kind in ((png, "png"), (svg, "svg")) if path is not None]
    if not targets:
        raise TimelineError("nothing to write: give a PNG path, an SVG path or both")
    if not picture.rows:
        raise TimelineError(f"request {picture.request_id!r} has an empty timeline")
    placed = layout(picture.rows)
    lanes = {item.lane for item in placed}
    if len(lanes) > MAX_LANES:
        raise TimelineError(
            f"request {picture.request_id!r}: its timeline names {len(lanes)} processes, a lane "
            f"each: more than {MAX_LANES} do not fit the picture"
        )
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Text stays text in the SVG, and its element ids do not change from run to run. Text is
    # the answer's, drawn as it is: a "$" in it is no mathtext for matplotlib to parse.
    settings = {"svg.fonttype": "none", "svg.hashsalt": "kvtransfer", "text.parse_math": False}
    with mpl.rc_context(settings):
        for path, kind in targets:
            # A figure per file: one laid out for another format first would shift the SVG's
            # clip boxes by a rounding, and with them its ids.
            figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
            FigureCanvasAgg(figure)
            _draw_axes(figure.add_subplot(), picture, placed)
            path.parent.mkdir(parents=True, exist_ok=True)
            # No date or version in the metadata: the same timeline gives the same file.
            metadata = {"Date": None} if kind == "svg" else {"Software": None}
            figure.savefig(path, format=kind, metadata=metadata)
    return [path for path, _ in targets]


def _draw_axes(axes: Axes, picture: Handover, placed: Sequence[_Placed]) -> None:
    from matplotlib.patches import Patch

    depth: dict[str, int] = {}  # lanes in the order of their first span, and their rows
    for item in placed:
        depth[item.lane] = max(depth.get(item.lane, 0), item.line + 1)
    lanes = list(depth)
    # y of each lane's first row, top down; a gap between lanes.
    top: dict[str, float] = {}
    y = 0.0
    for lane in lanes:
        top[lane] = y
        y += depth[lane] + 0.6
    end = max(p.row.end_ms for p in placed)
    if picture.ttft_ms is not None:
        end = max(end, picture.ttft_ms)
    span_ms = end if end > 0 else 1.0
    # A bar is at least this wide, so that a span of microseconds still shows.
    min_width = span_ms * 0.0025
    px_per_ms = WIDTH_IN * DPI * 0.92 / span_ms
    # What is drawn is cut to a little more than the axes show: a row far outside (a skewed
    # clock, a hostile answer) would put the renderer's coordinates past what it handles.
    window = (-0.01 * span_ms, 1.02 * span_ms)
    used: set[_Phase] = set()
    for item in placed:
        row = item.row
        phase = _PHASES.get(row.name, _OTHER)
        centre = top[item.lane] + item.line + 0.5
        gid = f"{row.name}.{item.number}"
        if _is_marker(row):
            if not window[0] <= row.start_ms <= window[1]:
                continue
            # On its row's top edge, pointing at the instant (and at the bar there, if any).
            (marker,) = axes.plot(
                [row.start_ms], [centre - 0.42], marker="v", color=_FIRST_TOKEN, markersize=8
            )
            marker.set_gid(gid)
            continue
        shown = _shown(row.start_ms, max(row.duration_ms, min_width), window)
        if shown is None:
            continue
        left, width = shown
        used.add(phase)
        color = phase.color
        if phase.other is not None and item.number % 2:
            color = phase.other
        (bar,) = axes.barh(
            centre,
            width,
            left=left,
            height=0.72,
            color=color,
            edgecolor="#4d4d4d",
            linewidth=0.4,
        )
        bar.set_gid(gid)
        text = _bar_text(row, item.number)
        if text and len(text) * 6.5 + 4 < width * px_per_ms:
            axes.text(
                left + width / 2,
                centre,
                text,
                ha="center",
                va="center",
                fontsize=7.5,
                color="#1a1a1a",
                clip_on=True,
            )
    if picture.ttft_ms is not None:
        axes.axvline(picture.ttft_ms, color=_FIRST_TOKEN, linestyle="--", linewidth=1.2)
        axes.text(
            picture.ttft_ms,
            -0.25,
            f" first token, TTFT at the router: {picture.ttft_ms:.1f} ms",
            color=_FIRST_TOKEN,
            fontsize=8.5,
            va="bottom",
            ha="left",
        )
    axes.set_ylim(y - 0.6 + 0.1, -0.9)
    axes.set_xlim(0, span_ms * 1.01)
    axes.set_yticks([top[lane] + depth[lane] / 2 for lane in lanes], lanes, fontsize=10)
    axes.tick_params(axis="y", length=0)
    for lane in lanes[1:]:
        axes.axhline(top[lane] - 0.3, color="#999999", linewidth=0.6)
    axes.set_xlabel("ms since the request reached the router")
    axes.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    axes.set_axisbelow(True)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    handles = [
        Patch(facecolor=p.color, edgecolor="#4d4d4d", label=p.label)
        for p in _LEGEND_ORDER
        if p in used
    ]
    if any(_is_marker(p.row) for p in placed):
        from matplotlib.lines import Line2D

        handles.append(
            Line2D([], [], marker="v", color=_FIRST_TOKEN, linestyle="", label="token handed on")
        )
    # A figure legend, so that the layout keeps room for it below the lanes.
    axes.figure.legend(
        handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False
    )
    axes.figure.suptitle(_title(picture), fontsize=11, x=0.01, ha="left")


def _shown(left: float, width: float, window: tuple[float, float]) -> tuple[float, float] | None:
    """The part of a bar from ``left``, ``width`` wide, within ``window``; None if none is."""
    low, high = window
    if low <= left and left + width <= high:
        return left, width  # as it is (no arithmetic to round)
    start, end = max(left, low), min(left + width, high)
    return (start, end - start) if start < end else None


def _bar_text(row: TimelineRow, number: int) -> str:
    if row.name.endswith(("model.layer", "kv.save_layer", "kv.wait_layer")):
        match = _LAYER_INDEX.search(str(row.attributes.get("layer", "")))
        return f"L{match.group(1)}" if match else ""
    if row.name == "decode.kv.read":
        return _size(_int(row.attributes.get("bytes")))
    if row.name == "decode.engine.step":
        return str(row.attributes.get("step", number + 1))
    if row.name == "router.pick":
        return str(row.attributes.get("role", "pick"))
    span = row.name.partition(".")[2]
    return _SHORT.get(span, span)


def _title(picture: Handover) -> str:
    parts = [f"request {picture.request_id}"]
    if picture.prompt_tokens is not None:
        parts.append(f"{picture.prompt_tokens} prompt tokens")
    reads = picture.named("decode.kv.read")
    if picture.kv_bytes:
        count = f"{len(reads)} read" + ("" if len(reads) == 1 else "s")
        parts.append(f"{_size(picture.kv_bytes)} of KV moved in {count}")
    layers = picture.named("prefill.model.layer")
    if layers:
        parts.append(f"{len(layers)} layers")
    return "P/D handover: " + ", ".join(parts)


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} B"
