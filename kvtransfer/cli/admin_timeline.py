"""``kvtransfer admin timeline``: draw one request's timeline, read from a saved router answer.

The router sends each request's timeline in its answer (the ``kvtransfer`` object) and keeps
none of them: save the answer (``curl ... > answer.json``; a stream's ``data:`` lines as they
came are fine too) and draw it here, as PNG and/or SVG (`kvtransfer.timeline_picture`).
Exit status as the other actions: 2 for bad arguments (no output named, an unreadable file),
1 when the answer holds nothing to draw (no timeline, another request id) or nothing that can
be (a time that is no finite number, too many rows: `kvtransfer.timeline_picture`'s limits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_timeline_parser(actions: argparse._SubParsersAction) -> None:
    timeline = actions.add_parser(
        "timeline",
        help="draw a request's timeline from a saved router answer (PNG, SVG)",
        description="Draw one request's timeline, read from a saved router answer, as PNG "
        "and/or SVG. The router keeps no answers: save one (curl ... > answer.json).",
    )
    timeline.add_argument(
        "answer",
        metavar="ANSWER",
        help="a router answer saved as JSON, or a stream's 'data:' lines; - reads stdin",
    )
    timeline.add_argument("--request-id", metavar="ID", help="which one, if it holds several")
    timeline.add_argument("--png", type=Path, metavar="PATH", help="write the picture as PNG")
    timeline.add_argument("--svg", type=Path, metavar="PATH", help="write the picture as SVG")
    timeline.add_argument("--json", action="store_true", help="print one JSON object")


def run_timeline(args: argparse.Namespace) -> int:
    from kvtransfer.timeline_picture import TimelineError, draw, handover, read_answer

    if args.png is None and args.svg is None:
        return _fail("timeline needs --png PATH, --svg PATH or both", 2)
    try:
        text = sys.stdin.read() if args.answer == "-" else Path(args.answer).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"cannot read ANSWER {args.answer!r}: {exc}", 2)
    try:
        picture = handover(read_answer(text), args.request_id)
        written = draw(picture, args.png, args.svg)
    except TimelineError as exc:
        return _fail(f"{args.answer}: {exc}", 1)
    except OSError as exc:
        return _fail(f"cannot write the picture: {exc}", 1)
    if args.json:
        files = [str(path) for path in written]
        spans = len(picture.rows)
        print(json.dumps({"request_id": picture.request_id, "spans": spans, "files": files}))
    else:
        names = ", ".join(str(path) for path in written)
        print(f"request {picture.request_id}: {len(picture.rows)} spans drawn to {names}")
    return 0


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
