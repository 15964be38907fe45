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
import secrets
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtransfer.router.echo import ECHO_CHARS, clipped, echo

MAX_STOP = 4
# Choices one request may ask for (prompts x n): each is a prefill and a decode of its own.
MAX_CHOICES = 128
# The most alternatives per position a client may ask log-probabilities for (as vLLM).
MAX_LOGPROBS = 20
_UINT32_MAX = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Objects and arrays inside each other, the body itself being level 1. A chat request needs 4
# (body, messages, a message, its content parts); the bound keeps parsing and checking cheap.
MAX_JSON_DEPTH = 64
# Only an escape can put a surrogate into a decoded string (strict UTF-8 decoding refuses the
# raw bytes), so bodies without one skip the string walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# Fields whose other values cannot be honoured: rejected rather than silently ignored. A value
# equal to the default (type included: ``true`` is not 1) or ``null`` passes.
_UNSUPPORTED_ANY: dict[str, object] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "suffix": None,
}
_UNSUPPORTED_CHAT: dict[str, object] = {
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "audio": None,
    "prediction": None,
    "continue_final_message": False,
}
_ROLES = frozenset({"system", "developer", "user", "assistant"})


class InvalidRequest(ValueError):
    """A malformed request; ``param`` names the field (``None``: the whole body)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatMessages:
    """A conversation for the prefill daemon to render with its chat template."""

    messages_json: str
    add_generation_prompt: bool = True


Prompt = str | tuple[int, ...] | ChatMessages


@dataclass(frozen=True)
class Choice:
    """One completion to produce: a prompt and how to sample it (its own seed), on one prefill
    and one decode daemon. ``index`` is its place in the answer's ``choices``; ``sample`` its
    place among the ``n`` samples of its prompt."""

    index: int
    sample: int
    prompt: Prompt
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str | None = None
    # Bounds follow the proto fields (uint32 max_tokens, int64 seed) so nothing overflows there.
    max_tokens: int = Field(default=16, ge=1, le=_UINT32_MAX)
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    # vLLM's extension, sent by load generators that want exact output lengths.
    ignore_eos: bool = False

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

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options: only allowed when stream is true", "stream_options"
            )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _choices(self, prompts: list[Prompt], logprobs: int | None) -> tuple[Choice, ...]:
        total = len(prompts) * self.n
        if total > MAX_CHOICES:
            raise InvalidRequest(
                f"n: {len(prompts)} prompts x n={self.n} is {total} choices, at most "
                f"{MAX_CHOICES} per request",
                "n",
            )
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(self.n):
                choices.append(
                    Choice(
                        index=p * self.n + j,
                        sample=j,
                        prompt=prompt,
                        max_tokens=self.max_tokens,
                        temperature=self.temperature,
                        top_p=self.top_p,
                        seed=self._seed(j),
                        stop=tuple(self.stop),
                        ignore_eos=self.ignore_eos,
                        logprobs=logprobs,
                    )
                )
        return tuple(choices)

    def _seed(self, sample: int) -> int | None:
        """Sample ``j`` of a prompt is seeded ``seed + j`` (wrapping within int64), so each
        choice is what one request with that seed gives. Unseeded random sampling gets a seed
        drawn here: the prefill (first token) and the decode (the rest) must share it."""
        if self.seed is not None:
            return (self.seed + sample - _INT64_MIN) % 2**64 + _INT64_MIN
        if self.temperature == 0:
            return None
        return secrets.randbits(63)


class CompletionRequest(SamplingRequest):
    """One validated ``/v1/completions`` body; ``prompt`` is normalised to a list of prompts,
    each one string or one list of token ids."""

    prompt: list[str | list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_batch(cls, value: Any) -> Any:
        # One pass per check over what may be thousands of token ids (on every request's path).
        if isinstance(value, str) or _is_int_list(value):
            value = [value]
        if value == [] or value == [""]:
            raise ValueError("must not be empty")
        if not isinstance(value, list):
            raise ValueError(_PROMPT_SHAPE)
        for index, prompt in enumerate(value):
            where = f"[{index}]: " if len(value) > 1 else ""
            if prompt == "" or prompt == []:
                raise ValueError(f"{where}must not be empty")
            if isinstance(prompt, str):
                continue
            if not _is_int_list(prompt):
                raise ValueError(f"{where}{_PROMPT_SHAPE}")
            if not _are_token_ids(prompt):
                raise ValueError(f"{where}token ids must be integers in [0, 2**32)")
        return value

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(
                "best_of: not supported by this router (only best_of equal to n)", "best_of"
            )
        if self.echo and self.logprobs is not None:
            raise InvalidRequest(
                "echo: not supported with logprobs (prompt log-probabilities are not computed)",
                "echo",
            )
        if self.echo and not all(isinstance(p, str) for p in self.prompt):
            raise InvalidRequest("echo: only supported for text prompts", "echo")
        return self

    def choices(self) -> tuple[Choice, ...]:
        prompts: list[Prompt] = [p if isinstance(p, str) else tuple(p) for p in self.prompt]
        return self._choices(prompts, self.logprobs)


class ChatCompletionRequest(SamplingRequest):
    """One validated ``/v1/chat/completions`` body, its messages normalised (text content)."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _text_messages(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty list of messages")
        return [_chat_message(message, index) for index, message in enumerate(value)]

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: requires logprobs to be true", "top_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise InvalidRequest(
                f"response_format: type {echo(kind)} is not supported (only 'text')",
                "response_format",
            )
        return self

    def choices(self) -> tuple[Choice, ...]:
        prompt = ChatMessages(
            json.dumps(self.messages, ensure_ascii=False), self.add_generation_prompt
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = self.max_completion_tokens
        request = self if limit is None else self.model_copy(update={"max_tokens": limit})
        return request._choices([prompt], logprobs)


_PROMPT_SHAPE = "must be a string, a list of non-negative token ids, or a list of such prompts"


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    """A message with text content only: content parts of type "text" joined with newlines
    (as vLLM does for string-content templates); images, audio and tool calls refused."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where}: must be an object with a role and content")
    role = message.get("role")
    if role == "tool" or ("tool_calls" in message and message["tool_calls"] is not None):
        raise ValueError(f"{where}: tool calls and tool messages are not supported")
    if role not in _ROLES:
        roles = ", ".join(sorted(_ROLES))
        raise ValueError(f"{where}.role: must be one of {roles}, got {echo(role)}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"{where}.content[{k}]: only text parts are supported (text-only model), "
                    f"got type {echo(kind)}"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: must be a string or a list of text parts")
    normalised: dict[str, Any] = {"role": role, "content": content}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: must be a string")
        normalised["name"] = name
    return normalised


# JSON decodes integers as int and true/false as bool, never subclasses.
_INT_TYPES = frozenset({int, bool})


def _is_int_list(value: Any) -> bool:
    """A list of integers (booleans too: a token id list with a mistake in it)."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) <= _INT_TYPES


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT32_MAX


def _are_token_ids(values: list[Any]) -> bool:
    """`_is_token_id` of every item, in C loops (a bool's type is not int)."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= _UINT32_MAX


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
            clipped(str(path[0]), ECHO_CHARS) if path else None,
        ) from None


def _json_path(path: tuple[str | int, ...]) -> str:
    parts = []
    for step in path:
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}" if parts else step)
    return clipped("".join(parts), ECHO_CHARS)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded ``/v1/completions`` body; raises `InvalidRequest` naming the first
    bad field."""
    return _parse(CompletionRequest, body, _UNSUPPORTED_ANY)


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a decoded ``/v1/chat/completions`` body (see `parse_completion_request`)."""
    return _parse(ChatCompletionRequest, body, {**_UNSUPPORTED_ANY, **_UNSUPPORTED_CHAT})


_Request = TypeVar("_Request", bound=SamplingRequest)


def _parse(model: type[_Request], body: Any, unsupported: dict[str, object]) -> _Request:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    for name, default in unsupported.items():
        value = body.get(name)
        # type() too: ``true`` equals 1 and ``0`` equals False, but neither is the default.
        if value is not None and (value != default or type(value) is not type(default)):
            raise InvalidRequest(f"{name}: not supported by this router", name)
    if body.get("logit_bias"):
        raise InvalidRequest("logit_bias: not supported by this router", "logit_bias")
    fields = {k: v for k, v in body.items() if v is not None}
    try:
        return model.model_validate(fields)
    except InvalidRequest:
        raise
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else None
        message = error["msg"].removeprefix("Value error, ")
        if isinstance(error.get("ctx", {}).get("error"), InvalidRequest):
            invalid = error["ctx"]["error"]
            raise InvalidRequest(str(invalid), invalid.param) from None
        if message.startswith("messages["):  # already names the message and its field
            raise InvalidRequest(message, field) from None
        raise InvalidRequest(f"{field}: {message}", field) from None


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
