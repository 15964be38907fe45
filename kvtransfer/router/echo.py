"""How much of someone else's text the router's own messages repeat: an error that quotes a
client's field (a model name, a ``response_format`` type, an address) quotes at most
`ECHO_CHARS` of it, so that a request with an 8 MiB model name is not answered, logged and shown
on the fleet page with 8 MiB."""

from __future__ import annotations

import reprlib

ECHO_CHARS = 100
ELLIPSIS = "…"


def _short_repr() -> reprlib.Repr:
    # Containers are summarised (a few items, two levels deep): a field may be any JSON value.
    short = reprlib.Repr()
    short.maxlevel = 2
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    short.maxstring = short.maxother = ECHO_CHARS
    return short


_SHORT_REPR = _short_repr()


def clipped(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and an ellipsis when it is longer."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return text if len(text) <= limit else text[:limit] + ELLIPSIS


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters of it (then an ellipsis); a
    long string is cut before it is quoted, so the quote stays readable."""
    if isinstance(value, str):
        return repr(value[:limit]) + (ELLIPSIS if len(value) > limit else "")
    return clipped(_SHORT_REPR.repr(value), limit)
