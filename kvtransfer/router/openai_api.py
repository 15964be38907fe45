"""The OpenAI completions request the router accepts, validated, and the responses it sends."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4
# Fields whose non-default values we cannot honour: rejected rather than silently ignored.
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None}


class InvalidRequest(ValueError):
    """A malformed completions request; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stream: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        # OpenAI allows a batch; one prompt (text or ids) wrapped in a list is accepted.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise ValueError("must be a string, or a list of non-negative token ids")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return value


def parse_completion_request(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    for name, default in _UNSUPPORTED.items():
        if body.get(name, default) not in (default, None):
            raise InvalidRequest(f"{name}: not supported by this router", name)
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{field}: {message}", field) from None


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def completion_body(
    completion_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int] | None,
    kvtransfer: dict[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if usage is not None:
        body["usage"] = usage
    if kvtransfer is not None:
        body["kvtransfer"] = kvtransfer
    return body
