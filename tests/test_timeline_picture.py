"""The handover picture: a saved router answer read (JSON, a stream's lines), checked (typed
errors naming what is wrong) and drawn as PNG and SVG; end to end from a real P/D request
through `kvtransfer admin timeline`."""

from __future__ import annotations

import json
import math
import struct
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from serve_helpers.daemons import daemon_pair, running, start_router

from kvtransfer.cli import main
from kvtransfer.timeline_picture import (
    MAX_LANES,
    MAX_ROWS,
    PNG_SIZE_PX,
    Handover,
    TimelineError,
    TimelineRow,
    draw,
    handover,
    layout,
    read_answer,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"


def _row(name: str, start: float, duration: float, **attributes: object) -> dict:
    row: dict = {"name": name, "start_ms": start, "duration_ms": duration}
    if attributes:
        row["attributes"] = attributes
    return row


# The shape of a real answer's timeline (a P/D request of 40 tokens, 2 layers, streamed).
TIMELINE = [
    _row("router.parse", 0.0, 0.2),
    _row("router.pick", 0.5, 0.08, role="decode"),
    _row("router.pick", 0.6, 0.04, role="prefill"),
    _row("router.prefill_call", 0.7, 20.0, instance="p", kv_stream=True),
    _row("prefill.admit", 3.5, 1.0),
    _row("prefill.engine.queue", 4.5, 0.2),
    _row("prefill.engine.compute", 4.7, 15.0, cached_tokens=0, prompt_tokens=40),
    _row("prefill.model.layer", 6.0, 6.0, layer="model.layers.0.self_attn"),
    _row("prefill.kv.save_layer", 12.0, 0.05, layer="model.layers.0.self_attn"),
    _row("router.decode_call", 12.1, 40.0, instance="d"),
    _row("prefill.model.layer", 12.05, 6.0, layer="model.layers.1.self_attn"),
    _row("decode.engine.kv_wait", 13.0, 6.5, tokens=40, failed=False),
    _row("decode.kv.read", 13.5, 0.6, layers=1, bytes=8192, one_sided=True),
    _row("prefill.kv.save_layer", 18.05, 0.05, layer="model.layers.1.self_attn"),
    _row("decode.kv.read", 18.2, 0.5, layers=1, bytes=8192, one_sided=True),
    _row("prefill.first_token_out", 19.8, 0.0),
    _row("router.first_token_out", 20.5, 0.1),
    _row("decode.engine.compute", 19.6, 8.0, cached_tokens=0, prompt_tokens=40),
    _row("decode.first_token_out", 27.7, 0.001),
    _row("decode.engine.step", 27.6, 6.0, step=1, tokens=1),
    _row("decode.engine.step", 33.6, 6.0, step=2, tokens=1),
]
INFO = {
    "request_id": "cmpl-1",
    "ttft_s": 0.0206,
    "kv_bytes_received": 16384,
    "timeline": TIMELINE,
    "timeline_origin_unix_ns": 1_700_000_000_000_000_000,
}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def svg_ids(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG_NS}svg"
    return [element.get("id", "") for element in root.iter()]


def svg_text(path: Path) -> str:
    root = ET.parse(path).getroot()
    return " ".join("".join(element.itertext()) for element in root.iter(f"{SVG_NS}text"))


# ---------------------------------------------------------------------- reading


@pytest.mark.unit
def test_every_shape_of_a_saved_answer_reads_to_its_kvtransfer_object():
    answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x"}], "kvtransfer": INFO}
    several = {"choices": [{"index": 0, "kvtransfer": INFO}, {"index": 1, "kvtransfer": {}}]}
    stream = "data: " + json.dumps({"choices": [{}]}) + "\n\ndata: " + json.dumps(answer)
    stream += "\n\ndata: [DONE]\n\n"
    for text in (json.dumps(answer), json.dumps(INFO), json.dumps(several), stream):
        picture = handover(read_answer(text))
        assert picture.request_id == "cmpl-1"
        assert picture.rows[0] == TimelineRow("router.parse", 0.0, 0.2)
        assert len(picture.rows) == len(TIMELINE)
    picture = handover([INFO])
    assert (picture.prompt_tokens, picture.kv_bytes, picture.ttft_ms) == (40, 16384, 20.6)


@pytest.mark.unit
def test_what_cannot_be_drawn_is_refused_naming_why():
    def refused(infos: list, request_id: str | None = None) -> str:
        with pytest.raises(TimelineError) as caught:
            handover(infos, request_id)
        return str(caught.value)

    assert refused([INFO], "cmpl-9") == ("request id 'cmpl-9' is not in the answer (it has cmpl-1)")
    assert refused([{**INFO, "timeline": []}]) == (
        "request 'cmpl-1' has an empty timeline: nothing to draw"
    )
    assert refused([INFO, {**INFO, "request_id": "cmpl-2"}]) == (
        "the answer has 2 requests (cmpl-1, cmpl-2): name one"
    )
    assert refused([{"request_id": "cmpl-1"}]) == (
        "the answer has no kvtransfer timeline (a router answer's kvtransfer object carries one)"
    )
    bad_row = {**INFO, "timeline": [_row("router.parse", 0.0, -1.0)]}
    assert refused([bad_row]) == (
        "request 'cmpl-1': timeline row 0 (router.parse): duration_ms must be >= 0, got -1.0"
    )
    no_start = {**INFO, "timeline": [{"name": "router.parse", "duration_ms": 1}]}
    assert refused([no_start]) == (
        "request 'cmpl-1': timeline row 0 (router.parse): start_ms must be a finite number, "
        "got None"
    )
    with pytest.raises(TimelineError, match="not a JSON answer nor a stream of 'data: ' lines"):
        read_answer("<html>502</html>")
    with pytest.raises(TimelineError, match="nothing to write: give a PNG path, an SVG path"):
        draw(handover([INFO]))


# ---------------------------------------------------------------------- drawing


@pytest.mark.unit
def test_spans_that_overlap_in_a_lane_take_rows_of_their_own():
    placed = {(p.row.name, p.number): (p.lane, p.line) for p in layout(handover([INFO]).rows)}
    # The router's own work, then its prefill call, on one row; the decode call beside it.
    assert placed["router.parse", 0] == placed["router.prefill_call", 0] == ("router", 0)
    assert placed["router.decode_call", 0] == ("router", 1)
    # Layers above the compute they are part of; reads and saves in the KV lane.
    assert placed["prefill.model.layer", 1] == ("prefill", 0)
    assert placed["prefill.engine.compute", 0] == ("prefill", 1)
    assert placed["decode.kv.read", 1][0] == placed["prefill.kv.save_layer", 0][0] == "KV"
    # Steps follow one another on one row even where rounding makes them touch.
    assert placed["decode.engine.step", 0] == placed["decode.engine.step", 1]


@pytest.mark.unit
def test_a_names_spans_share_a_row_unless_they_overlap_each_other():
    rows = (
        TimelineRow("prefill.admit", 0.0, 4.0),
        TimelineRow("prefill.model.layer", 3.0, 2.0),  # overlaps the admit
        TimelineRow("prefill.model.layer", 5.0, 2.0),
        TimelineRow("decode.kv.read", 1.0, 5.0),
        TimelineRow("decode.kv.read", 2.0, 1.0),  # a read beside another
    )
    lines = {(p.row.name, p.number): p.line for p in layout(rows)}
    assert lines["prefill.model.layer", 0] == lines["prefill.model.layer", 1] == 1
    assert (lines["decode.kv.read", 0], lines["decode.kv.read", 1]) == (0, 1)


@pytest.mark.unit
def test_the_picture_is_a_png_and_an_svg_with_a_bar_per_span(tmp_path):
    picture = handover([INFO])
    png, svg = tmp_path / "h.png", tmp_path / "sub" / "h.svg"
    assert draw(picture, png, svg) == [png, svg]
    assert png_size(png.read_bytes()) == PNG_SIZE_PX == (1200, 640)
    ids = svg_ids(svg)
    for name in {row["name"] for row in TIMELINE}:
        count = sum(row["name"] == name for row in TIMELINE)
        assert [i for i in ids if i.rsplit(".", 1)[0] == name] == [
            f"{name}.{n}" for n in range(count)
        ], name
    text = svg_text(svg)
    assert "P/D handover: request cmpl-1, 40 prompt tokens, 16 KiB of KV moved in 2 reads" in text
    for label in ("a layer computed", "KV read by decode (one-sided)", "decode steps"):
        assert label in text
    assert "first token, TTFT at the router: 20.6 ms" in text
    # The same timeline gives the same SVG (no date, stable ids): pictures can be committed.
    again = tmp_path / "again.svg"
    draw(picture, svg=again)
    assert again.read_bytes() == svg.read_bytes()


@pytest.mark.unit
def test_a_span_of_an_unknown_process_gets_a_lane_of_its_own(tmp_path):
    rows = (TimelineRow("router.parse", 0, 1), TimelineRow("cache.lookup", 0.5, 2, {"n": 1}))
    placed = layout(rows)
    assert [(p.row.name, p.lane, p.line) for p in placed] == [
        ("router.parse", "router", 0),
        ("cache.lookup", "cache", 0),
    ]
    assert draw(Handover("r", rows), svg=tmp_path / "x.svg") == [tmp_path / "x.svg"]
    assert "cache.lookup.0" in svg_ids(tmp_path / "x.svg")


# ---------------------------------------------------------------------- hostile answers


def _refused(info: dict) -> str:
    with pytest.raises(TimelineError) as caught:
        handover([info])
    return str(caught.value)


@pytest.mark.unit
def test_a_ttft_that_is_no_finite_number_of_seconds_is_refused():
    # JSON's Infinity and NaN, a bool (True was 1000 ms), an int past float's range: each
    # reached matplotlib's axis limits (an uncaught ValueError) or drew a line nowhere.
    for ttft, shown in (
        (math.inf, "inf"),
        (math.nan, "nan"),
        (True, "True"),
        (-0.5, "-0.5"),
        ("0.02", "'0.02'"),
        (10**400, repr(10**400)[:57] + "..."),
    ):
        assert _refused({**INFO, "ttft_s": ttft}) == (
            f"request 'cmpl-1': ttft_s must be a number from 0 to 1e+09, got {shown}"
        )
    assert handover([{**INFO, "ttft_s": None}]).ttft_ms is None


@pytest.mark.unit
def test_a_row_whose_end_is_past_floats_range_is_refused():
    # Each of start_ms and duration_ms is finite; their sum is not.
    huge = {**INFO, "timeline": [_row("router.parse", 1e308, 1e308)]}
    assert _refused(huge) == (
        "request 'cmpl-1': timeline row 0 (router.parse): start_ms and its end "
        "(start_ms + duration_ms) must lie within ±1e+12 ms, got 1e+308 and inf"
    )
    beyond = {**INFO, "timeline": [_row("router.parse", 10**400, 1)]}
    assert _refused(beyond) == (
        "request 'cmpl-1': timeline row 0 (router.parse): start_ms must be a finite number, "
        f"got {repr(10**400)[:57]}..."
    )


@pytest.mark.unit
def test_text_no_font_draws_is_refused_naming_where():
    # JSON's "\ud800" is a str that matplotlib cannot draw (a TypeError) nor a file hold.
    assert _refused({**INFO, "request_id": "cmpl-\ud800"}) == (
        "request id is not Unicode text (a lone surrogate): 'cmpl-\\ud800'"
    )
    row = _row("router.pick", 0.5, 0.08, role="\udfff")
    assert _refused({**INFO, "timeline": [row]}) == (
        "request 'cmpl-1': timeline row 0 (router.pick): attribute 'role' is not Unicode text "
        "(a lone surrogate): '\\udfff'"
    )


@pytest.mark.unit
def test_json_nested_past_the_parser_or_with_overlong_integers_is_refused():
    deep = "[" * 100_000 + "]" * 100_000
    for text in (deep, f"data: {deep}\n\ndata: [DONE]\n"):
        with pytest.raises(TimelineError) as caught:
            read_answer(text)
        assert str(caught.value) == "the answer is nested too deeply to read"
    with pytest.raises(TimelineError) as caught:
        read_answer('{"kv_bytes_received": ' + "7" * 5000 + "}")
    assert str(caught.value) == "the answer holds an integer of more than 4300 digits"
    # As deep as the parser reads, the answer is walked without recursion.
    nested = "[" * 600 + json.dumps(INFO) + "]" * 600
    assert read_answer(nested) == [INFO]


@pytest.mark.unit
def test_a_timeline_past_the_row_limit_is_refused_and_one_at_it_laid_out():
    row = _row("decode.kv.read", 0.0, 1.0)
    assert _refused({**INFO, "timeline": [row] * (MAX_ROWS + 1)}) == (
        f"request 'cmpl-1' has {MAX_ROWS + 1} timeline rows: more than {MAX_ROWS} are not drawn"
    )
    # A pile of alike spans at the limit, each overlapping all the others: one row each (first
    # fit by scanning rows took minutes for 20000 such spans).
    pile = handover([{**INFO, "timeline": [row] * MAX_ROWS}])
    assert [p.line for p in layout(pile.rows)] == list(range(MAX_ROWS))


@pytest.mark.unit
def test_more_processes_than_lanes_fit_are_refused(tmp_path):
    rows = tuple(TimelineRow(f"p{n}.work", 0.0, 1.0) for n in range(MAX_LANES + 1))
    with pytest.raises(TimelineError) as caught:
        draw(Handover("r", rows), svg=tmp_path / "never-written.svg")
    assert str(caught.value) == (
        f"request 'r': its timeline names {MAX_LANES + 1} processes, a lane each: more than "
        f"{MAX_LANES} do not fit the picture"
    )
    assert not (tmp_path / "never-written.svg").exists()


@pytest.mark.unit
def test_text_with_dollar_signs_is_drawn_as_it_is_not_as_mathtext(tmp_path):
    # matplotlib parses text between two $ as mathtext: "$^^$" was a ParseSyntaxException.
    rows = [
        _row("router.parse", 0.0, 1.0),
        _row("router.pick", 1.0, 30.0, role="$^^$"),
        _row("x$^^$.work", 2.0, 30.0),
        _row("decode.cost$^$", 3.0, 30.0),
    ]
    picture = handover([{"request_id": "cmpl-$^^$", "timeline": rows}])
    svg = tmp_path / "d.svg"
    assert draw(picture, svg=svg) == [svg]
    text = svg_text(svg)
    for drawn in ("P/D handover: request cmpl-$^^$", "x$^^$", "cost$^$"):
        assert drawn in text
    assert {"x$^^$.work.0", "decode.cost$^$.0"} <= set(svg_ids(svg))


@pytest.mark.unit
def test_a_span_far_before_the_arrival_is_cut_at_the_axes(tmp_path):
    # Another host's clock 16 minutes behind: the read's label, centred a million ms left of
    # the axes, was past what FreeType renders (a RuntimeError).
    rows = (
        TimelineRow("router.parse", 0.0, 1.0),
        TimelineRow("decode.kv.read", -1e6, 1e6 + 1.0, {"bytes": 4096}),
        TimelineRow("decode.kv.handshake", -1e6, 1.0),  # wholly outside: left out
    )
    png, svg = tmp_path / "far.png", tmp_path / "far.svg"
    assert draw(Handover("r", rows), png, svg) == [png, svg]
    ids = svg_ids(svg)
    assert "decode.kv.read.0" in ids and "decode.kv.handshake.0" not in ids
    assert "4 KiB" in svg_text(svg)


# The answers above through `kvtransfer admin timeline`: exit status 1 and the message, no
# traceback, nothing written.
_HOSTILE = {
    "infinite-ttft": (
        json.dumps({"kvtransfer": INFO}).replace("0.0206", "Infinity"),
        "request 'cmpl-1': ttft_s must be a number from 0 to 1e+09, got inf",
    ),
    "nan-ttft": (
        json.dumps({"kvtransfer": INFO}).replace("0.0206", "NaN"),
        "request 'cmpl-1': ttft_s must be a number from 0 to 1e+09, got nan",
    ),
    "bool-ttft": (
        json.dumps({"kvtransfer": {**INFO, "ttft_s": True}}),
        "request 'cmpl-1': ttft_s must be a number from 0 to 1e+09, got True",
    ),
    "infinite-end": (
        json.dumps({"kvtransfer": {**INFO, "timeline": [_row("router.parse", 1e308, 1e308)]}}),
        "request 'cmpl-1': timeline row 0 (router.parse): start_ms and its end "
        "(start_ms + duration_ms) must lie within ±1e+12 ms, got 1e+308 and inf",
    ),
    "deep": ("[" * 100_000 + "]" * 100_000, "the answer is nested too deeply to read"),
    "many-rows": (
        json.dumps({**INFO, "timeline": [_row("decode.kv.read", 0.0, 1.0)] * (MAX_ROWS + 1)}),
        f"request 'cmpl-1' has {MAX_ROWS + 1} timeline rows: more than {MAX_ROWS} are not drawn",
    ),
    "many-lanes": (
        json.dumps(
            {**INFO, "timeline": [_row(f"p{n}.work", 0.0, 1.0) for n in range(MAX_LANES + 1)]}
        ),
        f"request 'cmpl-1': its timeline names {MAX_LANES + 1} processes, a lane each: more "
        f"than {MAX_LANES} do not fit the picture",
    ),
    "surrogate": (
        json.dumps({**INFO, "request_id": "cmpl-\ud800"}),
        "request id is not Unicode text (a lone surrogate): 'cmpl-\\ud800'",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_admin_timeline_exits_1_naming_what_a_hostile_answer_lacks(case, tmp_path, capsys):
    text, message = _HOSTILE[case]
    saved = tmp_path / "answer.json"
    saved.write_text(text)
    png, svg = tmp_path / "out.png", tmp_path / "out.svg"
    assert main(["admin", "timeline", str(saved), "--png", str(png), "--svg", str(svg)]) == 1
    assert capsys.readouterr() == ("", f"error: {saved}: {message}\n")
    assert not png.exists() and not svg.exists()


@pytest.mark.unit
def test_admin_timeline_draws_an_answer_with_dollar_signs(tmp_path, capsys):
    saved = tmp_path / "answer.json"
    saved.write_text(json.dumps({"kvtransfer": {**INFO, "request_id": "cmpl-$^^$"}}))
    svg = tmp_path / "out.svg"
    assert main(["admin", "timeline", str(saved), "--svg", str(svg)]) == 0
    assert capsys.readouterr() == (f"request cmpl-$^^$: {len(TIMELINE)} spans drawn to {svg}\n", "")
    assert "P/D handover: request cmpl-$^^$, 40 prompt tokens" in svg_text(svg)


# ---------------------------------------------------------------------- end to end

PROMPT = [(7 * i) % 200 + 30 for i in range(40)]
MAX_TOKENS = 6
NUM_LAYERS = 4  # builtin:tiny


@pytest.mark.integration
def test_a_real_pd_request_is_drawn_by_kvtransfer_admin_timeline(tmp_path, capsys):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    with daemon_pair(tmp_path, (), ()) as (prefill, decode):
        router = start_router(tmp_path, [prefill], [decode])
        with running(router):
            request = urllib.request.Request(
                f"{router.address}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                stream = response.read().decode()
    saved = tmp_path / "answer.txt"
    saved.write_text(stream)  # as the client got it: SSE lines
    (info,) = read_answer(stream)[-1:]
    timeline = info["timeline"]
    png, svg = tmp_path / "out" / "handover.png", tmp_path / "out" / "handover.svg"

    code = main(["admin", "timeline", str(saved), "--png", str(png), "--svg", str(svg), "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert json.loads(out) == {
        "request_id": info["request_id"],
        "spans": len(timeline),
        "files": [str(png), str(svg)],
    }
    assert png_size(png.read_bytes()) == PNG_SIZE_PX
    ids = svg_ids(svg)

    def drawn(name: str) -> list[str]:
        return [i for i in ids if i.startswith(f"{name}.") and i[len(name) + 1 :].isdigit()]

    # One bar per layer computed and per layer saved, one per read, one per decode step.
    counts = {
        name: sum(row["name"] == name for row in timeline)
        for name in (
            "prefill.model.layer",
            "prefill.kv.save_layer",
            "decode.kv.read",
            "decode.engine.step",
        )
    }
    assert counts["prefill.model.layer"] == counts["prefill.kv.save_layer"] == NUM_LAYERS
    assert counts["decode.kv.read"] >= 1
    # The prefill sampled the first token, the decode's first step the second: the rest are
    # steps.
    assert counts["decode.engine.step"] == MAX_TOKENS - 2
    for name, count in counts.items():
        assert drawn(name) == [f"{name}.{n}" for n in range(count)]
    text = svg_text(svg)
    assert f"P/D handover: request {info['request_id']}, {len(PROMPT)} prompt tokens" in text
    for label in ("a layer computed", "a layer's KV saved for decode", "decode waits for KV"):
        assert label in text

    # Another request id, and an answer with no timeline: typed, named, exit status 1.
    code = main(["admin", "timeline", str(saved), "--svg", str(svg), "--request-id", "cmpl-x"])
    _, err = capsys.readouterr()
    assert code == 1
    assert err == (
        f"error: {saved}: request id 'cmpl-x' is not in the answer (it has {info['request_id']})\n"
    )
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"kvtransfer": {**info, "timeline": []}}))
    assert main(["admin", "timeline", str(empty), "--png", str(png)]) == 1
    assert capsys.readouterr().err == (
        f"error: {empty}: request {info['request_id']!r} has an empty timeline: nothing to draw\n"
    )
    assert main(["admin", "timeline", str(saved)]) == 2
    assert capsys.readouterr().err == "error: timeline needs --png PATH, --svg PATH or both\n"
