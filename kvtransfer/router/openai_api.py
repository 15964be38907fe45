"""The OpenAI completions request the router accepts, validated, and the bodies it answers with.

Validation is strict on types (``"5"`` is not a number, ``true`` is not 1) so that a client's
mistake becomes a 400 naming the field instead of a surprising completion. ``null`` means "the
default" for every optional field, as OpenAI clients send it that way.

The body itself (`parse_json_body`) must be UTF-8 JSON nested at most `MAX_JSON_DEPTH` levels
whose strings, keys included, are valid Unicode: a lone surrogate escape such as ``"\\ud800"``
decodes in Python but cannot be encoded for a daemon. Each is a 400 naming the problem.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4
_UINT32_MAX = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Objects and arrays inside each other, the body itself being level 1. A completion request
# needs 3 (body, prompt batch, token ids); the bound keeps parsing and checking cheap.
MAX_JSON_DEPTH = 64
# Only an escape can put a surrogate into a decoded string (strict UTF-8 decoding refuses the
# raw bytes), so bodies without one skip the string walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Fields whose non-default values cannot be honoured: rejected rather than silently ignored.
_UNSUPPORTED: dict[str, object] = {"n": 1, "best_of": 1, "echo": False, "logprobs": None}


class InvalidRequest(ValueError):
    """A malformed completions request; ``param`` names the field (``None``: the whole body)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class CompletionRequest(BaseModel):
    """One validated ``/v1/completions`` body; ``prompt`` is normalised to one str or id list."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str | None = None
    prompt: str | list[int]
    # Bounds follow the proto fields (uint32 max_tokens, int64 seed) so nothing overflows there.
    max_tokens: int = Field(default=16, ge=1, le=_UINT32_MAX)
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # OpenAI allows a batch; a batch of one (text or ids) is the same request as its element.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if not all(_is_token_id(t) for t in value):
                raise ValueError("must be a string, or a list of non-negative token ids")
            return value
        raise ValueError("must be a string, or a list of non-negative token ids")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if len(value) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings")
            if any(isinstance(s, str) and not s for s in value):
                raise ValueError("stop strings must not be empty")
        return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT32_MAX


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body; raises `InvalidRequest` naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start} ({exc.reason})",
            None,
        ) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON", None) from None
    except RecursionError:  # far deeper than MAX_JSON_DEPTH
        raise _too_deep() from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", None) from None
    # Counting brackets (those inside strings too) is fast and bounds the depth from above.
    nested = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    if nested or _SURROGATE_ESCAPE.search(text):
        _check_tree(body, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return body


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"the request body is JSON nested deeper than {MAX_JSON_DEPTH} levels", None
    )


def _check_tree(body: Any, *, check_strings: bool) -> None:
    """Depth and (when asked) Unicode of every value, iteratively: no recursion to exhaust."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if check_strings and isinstance(value, str):
                _check_unicode(value, path)
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, item in items:
            if check_strings and isinstance(key, str):
                _check_unicode(key, path, key=True)
            if isinstance(item, dict | list) or (check_strings and isinstance(item, str)):
                stack.append((item, depth + 1, (*path, key)))


def _check_unicode(text: str, path: tuple[str | int, ...], *, key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _json_path(path) or "the request body"
        what = "a key" if key else "a string"
        surrogate = f"\\u{ord(text[exc.start]):04x}"
        raise InvalidRequest(
            f"{where}: {what} holds a lone surrogate ({surrogate}), which is not valid Unicode",
            str(path[0]) if path else None,
        ) from None


def _json_path(path: tuple[str | int, ...]) -> str:
    parts = []
    for step in path:
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}" if parts else step)
    return "".join(parts)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body; raises `InvalidRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    for name, default in _UNSUPPORTED.items():
        value = body.get(name)
        # type() too: ``true`` equals 1 and ``0`` equals False, but neither is the default.
        if value is not None and (value != default or type(value) is not type(default)):
            raise InvalidRequest(f"{name}: not supported by this router", name)
    fields = {k: v for k, v in body.items() if v is not None}
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{field}: {message}", field) from None


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_body(
    completion_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    *,
    created: int | None = None,
    usage: dict[str, int] | None = None,
    kvtransfer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole completion, or one streamed chunk of it (``usage`` omitted)."""
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage is not None:
        body["usage"] = usage
    if kvtransfer is not None:
        body["kvtransfer"] = kvtransfer
    return body
