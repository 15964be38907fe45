"""The bodies the router answers with, in OpenAI's two dialects: completions and chat.

Both dialects share the envelope (``id``, ``object``, ``created``, ``model``, ``choices``,
``usage``) and differ in a choice's shape: ``text`` against ``message``/``delta``, and the
layout of log-probabilities (the legacy ``tokens``/``token_logprobs``/``top_logprobs``/
``text_offset`` lists against chat's ``content`` entries with ``bytes``). A `ChoiceOutput` is
what the router knows of one choice at the end; streamed chunks are built from the pieces as
they come.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# JSON has no -Infinity: a token with zero probability gets this instead (as vLLM does).
_MIN_LOGPROB = -9999.0


class TokenLogprobLike(Protocol):
    token: str
    logprob: float


class OutputLogprobsLike(Protocol):
    """One output token's entry (``generation_pb2.OutputLogprobs`` fits)."""

    @property
    def sampled(self) -> TokenLogprobLike: ...

    @property
    def top(self) -> Sequence[TokenLogprobLike]: ...


@dataclass
class ChoiceOutput:
    """One choice, accumulated: what a non-streamed body holds of it."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[OutputLogprobsLike] = field(default_factory=list)
    finish_reason: str | None = None
    kvtransfer: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from a prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseFormat:
    """A dialect: the names and the choice shapes; the envelope is shared."""

    id_prefix: str
    object: str
    chunk_object: str

    def choice(self, output: ChoiceOutput, wants_logprobs: bool) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[OutputLogprobsLike] | None,
        *,
        first: bool,
        text_offset: int,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def body(
        self,
        response_id: str,
        created: int,
        model: str,
        choices: Sequence[dict[str, Any]],
        **extra: Any,
    ) -> dict[str, Any]:
        body = {
            "id": response_id,
            "object": self.object,
            "created": created,
            "model": model,
            "choices": list(choices),
        }
        body.update({k: v for k, v in extra.items() if v is not None})
        return body

    def chunk(
        self,
        response_id: str,
        created: int,
        model: str,
        choices: Sequence[dict[str, Any]],
        **extra: Any,
    ) -> dict[str, Any]:
        chunk = self.body(response_id, created, model, choices, **extra)
        chunk["object"] = self.chunk_object
        return chunk


class CompletionsFormat(ResponseFormat):
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, output: ChoiceOutput, wants_logprobs: bool) -> dict[str, Any]:
        logprobs = _legacy_logprobs(output.logprobs, 0) if wants_logprobs else None
        choice = {
            "index": output.index,
            "text": output.text,
            "finish_reason": output.finish_reason,
            "logprobs": logprobs,
        }
        if output.kvtransfer is not None:
            choice["kvtransfer"] = output.kvtransfer
        return choice

    def chunk_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[OutputLogprobsLike] | None,
        *,
        first: bool,
        text_offset: int,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else _legacy_logprobs(logprobs, text_offset),
        }


class ChatFormat(ResponseFormat):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, output: ChoiceOutput, wants_logprobs: bool) -> dict[str, Any]:
        choice = {
            "index": output.index,
            "message": {"role": "assistant", "content": output.text},
            "finish_reason": output.finish_reason,
            "logprobs": _chat_logprobs(output.logprobs) if wants_logprobs else None,
        }
        if output.kvtransfer is not None:
            choice["kvtransfer"] = output.kvtransfer
        return choice

    def chunk_choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[OutputLogprobsLike] | None,
        *,
        first: bool,
        text_offset: int,
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or first:
            delta["content"] = text
        return {
            "index": index,
            "delta": delta,
            "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else _chat_logprobs(logprobs),
        }


COMPLETIONS = CompletionsFormat()
CHAT = ChatFormat()


def _finite(logprob: float) -> float:
    return max(float(logprob), _MIN_LOGPROB)


def _legacy_logprobs(entries: Sequence[OutputLogprobsLike], text_offset: int) -> dict[str, Any]:
    """Completions' layout; ``text_offset`` is where the first token's text starts in the
    choice's text. Alternatives decoding to the same text share one key (the format's limit)."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.sampled.token)
    return {
        "tokens": [entry.sampled.token for entry in entries],
        "token_logprobs": [_finite(entry.sampled.logprob) for entry in entries],
        "top_logprobs": [{t.token: _finite(t.logprob) for t in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def _chat_logprobs(entries: Sequence[OutputLogprobsLike]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_chat_token(entry.sampled),
                "top_logprobs": [_chat_token(t) for t in entry.top],
            }
            for entry in entries
        ]
    }


def _chat_token(token: TokenLogprobLike) -> dict[str, Any]:
    return {
        "token": token.token,
        "logprob": _finite(token.logprob),
        "bytes": list(token.token.encode("utf-8")),
    }
