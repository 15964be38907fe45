"""A picture of one request's handover: its timeline (`kvtransfer.timeline`) drawn as swimlanes.

The input is what the router answers: the ``kvtransfer`` object of a completion (top level, in
a choice, or in a streamed chunk) with its ``timeline`` rows (``name`` as ``process.span``,
``start_ms`` and ``duration_ms`` from the request's arrival at the router). The picture has one
lane per party, router, prefill, KV and decode, and in each lane as many rows as its spans need
not to overlap; a span is one bar (its SVG element's id is ``name.N``, the N-th of that name),
a token handed on a marker. The router's TTFT (the answer's ``ttft_s``) is a vertical line.

matplotlib is imported only when drawing, with its Agg canvas (no display, no global backend
switched), so that reading answers costs nothing to a process that never draws.
"""

from __future__ import annotations

import itertools
import json
import math
import re
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
        document: Any = json.loads(text)
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
            document = [json.loads(chunk) for chunk in chunks]
        except json.JSONDecodeError as chunk_exc:
            raise TimelineError(f"a streamed chunk is not JSON: {chunk_exc.msg}") from None
    return list(_infos(document))


def _infos(document: Any) -> Iterable[dict[str, Any]]:
    if isinstance(document, list):
        for item in document:
            yield from _infos(item)
        return
    if not isinstance(document, dict):
        return
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
    rid = str(info.get("request_id", ""))
    rows = tuple(_row(rid, index, raw) for index, raw in enumerate(_rows_of(rid, info)))
    reads = sum(_int(row.attributes.get("bytes")) for row in rows if row.name == "decode.kv.read")
    ttft = info.get("ttft_s")
    return Handover(
        request_id=rid,
        rows=rows,
        kv_bytes=_int(info.get("kv_bytes_received")) or reads,
        ttft_ms=ttft * 1e3 if isinstance(ttft, int | float) else None,
    )


def _rows_of(rid: str, info: Mapping[str, Any]) -> list[Any]:
    rows = info["timeline"]
    if not isinstance(rows, list):
        raise TimelineError(f"request {rid!r}: timeline must be a list, got {type(rows).__name__}")
    if not rows:
        raise TimelineError(f"request {rid!r} has an empty timeline: nothing to draw")
    return rows


def _row(rid: str, index: int, raw: Any) -> TimelineRow:
    where = f"request {rid!r}: timeline row {index}"
    if not isinstance(raw, dict):
        raise TimelineError(f"{where} must be an object, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TimelineError(f"{where}: name must be a non-empty string, got {name!r}")
    numbers = {}
    for key in ("start_ms", "duration_ms"):
        value = raw.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise TimelineError(f"{where} ({name}): {key} must be a finite number, got {value!r}")
        numbers[key] = float(value)
    if numbers["duration_ms"] < 0:
        raise TimelineError(f"{where} ({name}): duration_ms must be >= 0, got {raw['duration_ms']}")
    attributes = raw.get("attributes") or {}
    if not isinstance(attributes, dict):
        raise TimelineError(f"{where} ({name}): attributes must be an object")
    return TimelineRow(name, numbers["start_ms"], numbers["duration_ms"], attributes)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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
    lanes = [lane for lane, _ in LANES]

    def lane_of(name: str) -> str:
        if name in order:
            return order[name][0]
        process = name.partition(".")[0]
        return _LANE_OF_PROCESS.get(process, process)

    by_name: dict[str, list[TimelineRow]] = {}
    for row in sorted(rows, key=lambda r: r.start_ms):
        by_name.setdefault(row.name, []).append(row)
        if lane_of(row.name) not in lanes:
            lanes.append(lane_of(row.name))

    def rank(name: str) -> tuple[int, int, float]:
        return lanes.index(lane_of(name)), order.get(name, ("", 99))[1], by_name[name][0].start_ms

    placed: list[_Placed] = []
    taken: dict[str, list[list[tuple[float, float]]]] = {}
    for name in sorted(by_name, key=rank):
        lane, spans = lane_of(name), list(enumerate(by_name[name]))
        lines = taken.setdefault(lane, [])
        if _is_marker(spans[0][1]):
            # Markers are drawn over whatever their lane's first row holds at that instant.
            placed += [_Placed(row, lane, 0, number) for number, row in spans]
            continue
        together = not any(
            _overlap(b, a.start_ms, a.end_ms) for (_, a), (_, b) in itertools.pairwise(spans)
        )
        for group in [spans] if together else [[span] for span in spans]:
            line = next(
                (
                    i
                    for i, used in enumerate(lines)
                    if not any(_overlap(row, *u) for _, row in group for u in used)
                ),
                len(lines),
            )
            if line == len(lines):
                lines.append([])
            lines[line] += [(row.start_ms, row.end_ms) for _, row in group]
            placed += [_Placed(row, lane, line, number) for number, row in group]
    return placed


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
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Text stays text in the SVG, and its element ids do not change from run to run.
    with mpl.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtransfer"}):
        for path, kind in targets:
            # A figure per file: one laid out for another format first would shift the SVG's
            # clip boxes by a rounding, and with them its ids.
            figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
            FigureCanvasAgg(figure)
            _draw_axes(figure.add_subplot(), picture)
            path.parent.mkdir(parents=True, exist_ok=True)
            # No date or version in the metadata: the same timeline gives the same file.
            metadata = {"Date": None} if kind == "svg" else {"Software": None}
            figure.savefig(path, format=kind, metadata=metadata)
    return [path for path, _ in targets]


def _draw_axes(axes: Axes, picture: Handover) -> None:
    from matplotlib.patches import Patch

    placed = layout(picture.rows)
    lanes = list(dict.fromkeys(p.lane for p in placed))
    depth = {lane: 1 + max(p.line for p in placed if p.lane == lane) for lane in lanes}
    # y of each lane's first row, top down; a gap between lanes.
    top: dict[str, float] = {}
    y = 0.0
    for lane in lanes:
        top[lane] = y
        y += depth[lane] + 0.6
    end = max(p.row.end_ms for p in placed)
    if picture.ttft_ms is not None:
        end = max(end, picture.ttft_ms)
    span_ms = end or 1.0
    # A bar is at least this wide, so that a span of microseconds still shows.
    min_width = span_ms * 0.0025
    px_per_ms = WIDTH_IN * DPI * 0.92 / span_ms
    used: set[_Phase] = set()
    for item in placed:
        row = item.row
        phase = _PHASES.get(row.name, _OTHER)
        centre = top[item.lane] + item.line + 0.5
        gid = f"{row.name}.{item.number}"
        if _is_marker(row):
            # On its row's top edge, pointing at the instant (and at the bar there, if any).
            (marker,) = axes.plot(
                [row.start_ms], [centre - 0.42], marker="v", color=_FIRST_TOKEN, markersize=8
            )
            marker.set_gid(gid)
            continue
        used.add(phase)
        color = phase.color
        if phase.other is not None and item.number % 2:
            color = phase.other
        width = max(row.duration_ms, min_width)
        (bar,) = axes.barh(
            centre,
            width,
            left=row.start_ms,
            height=0.72,
            color=color,
            edgecolor="#4d4d4d",
            linewidth=0.4,
        )
        bar.set_gid(gid)
        text = _bar_text(row, item.number)
        if text and len(text) * 6.5 + 4 < width * px_per_ms:
            axes.text(
                row.start_ms + width / 2,
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
