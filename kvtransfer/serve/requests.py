"""Turn a `GenerateRequest` into engine inputs, or a `RequestError` naming the bad field."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtransfer.engine.model.chat_template import ChatTemplate, ChatTemplateError
from kvtransfer.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvtransfer.v1 import generation_pb2

MAX_STOP_STRINGS = 8


class RequestError(ValueError):
    """A malformed Generate request; the message starts with the field's name."""


@dataclass(frozen=True)
class ParsedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    stop: tuple[str, ...]
    kv_transfer_params: dict[str, Any] | None
    # Outputs produced elsewhere (a prefill daemon's first token); the engine continues after.
    generated_token_ids: tuple[int, ...] = ()
    # They come later, through Continue.
    awaits_generated: bool = False
    # The prompt was a conversation rendered here (its tokens go back to the router).
    from_chat: bool = False


def parse_generate_request(
    request: generation_pb2.GenerateRequest,
    tokenizer: Any,
    vocab_size: int,
    chat_template: ChatTemplate | None = None,
) -> ParsedRequest:
    if not request.request_id:
        raise RequestError("request_id must not be empty")
    prompt = prompt_token_ids(request, tokenizer, vocab_size, chat_template)
    if not request.HasField("sampling"):
        raise RequestError("sampling is required (at least sampling.max_tokens)")
    sampling = request.sampling
    return ParsedRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        sampling_params=_sampling_params(sampling),
        stop=_stop_strings(sampling),
        kv_transfer_params=parse_transfer_params(request.kv_transfer_params_json),
        generated_token_ids=_generated_ids(request, vocab_size),
        awaits_generated=_awaits_generated(request),
        from_chat=request.WhichOneof("prompt") == "chat",
    )


def _awaits_generated(request: generation_pb2.GenerateRequest) -> bool:
    if request.await_generated_tokens and request.generated_token_ids:
        raise RequestError(
            "await_generated_tokens: the request already has generated_token_ids; set one"
        )
    return request.await_generated_tokens


def parse_continue_tokens(
    request: generation_pb2.ContinueRequest, vocab_size: int
) -> tuple[int, ...]:
    if not request.request_id:
        raise RequestError("request_id must not be empty")
    return _in_vocabulary(request.generated_token_ids, vocab_size)


def _in_vocabulary(token_ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    ids = tuple(token_ids)
    for index, token in enumerate(ids):
        if token >= vocab_size:
            raise RequestError(
                f"generated_token_ids[{index}] = {token} is outside the vocabulary "
                f"(size {vocab_size})"
            )
    return ids


def _generated_ids(request: generation_pb2.GenerateRequest, vocab_size: int) -> tuple[int, ...]:
    ids = _in_vocabulary(request.generated_token_ids, vocab_size)
    if len(ids) >= max(request.sampling.max_tokens, 1):
        raise RequestError(
            f"generated_token_ids holds {len(ids)} tokens, max_tokens "
            f"{request.sampling.max_tokens} leaves nothing to generate"
        )
    return ids


def prompt_token_ids(
    request: generation_pb2.GenerateRequest,
    tokenizer: Any,
    vocab_size: int,
    chat_template: ChatTemplate | None,
) -> tuple[int, ...]:
    """The engine's prompt for ``request``'s text, token ids or chat (the router tokenizes with
    this too, `kvtransfer.router.openai.tokens`); `RequestError` names a bad field."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RequestError("prompt: set text, token_ids or chat")
    if kind == "text":
        ids = tuple(tokenizer.encode(request.text))
    elif kind == "chat":
        text = _render_chat(request.chat, chat_template)
        # The template wrote the special tokens (e.g. BOS): none are added, as Hugging Face's
        # apply_chat_template tokenizes.
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = tuple(request.token_ids.ids)
        for index, token in enumerate(ids):
            if token >= vocab_size:
                raise RequestError(
                    f"prompt.token_ids[{index}] = {token} is outside the vocabulary "
                    f"(size {vocab_size})"
                )
    if not ids:
        raise RequestError("prompt must not be empty")
    return ids


def _render_chat(chat: generation_pb2.ChatPrompt, template: ChatTemplate | None) -> str:
    field = "prompt.chat.messages_json"
    try:
        messages = json.loads(chat.messages_json)
    except ValueError:
        raise RequestError(f"{field}: not valid JSON") from None
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{field}: must be a non-empty JSON array of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{field}[{index}]: must be an object with a string role")
    if template is None:
        raise RequestError("prompt.chat: this daemon renders no chat prompts")
    try:
        return template.render(messages, chat.add_generation_prompt)
    except ChatTemplateError as exc:
        raise RequestError(f"prompt.chat: {exc}") from None


def _sampling_params(sampling: generation_pb2.SamplingOptions) -> SamplingParams:
    if sampling.max_tokens < 1:
        raise RequestError(f"sampling.max_tokens must be >= 1, got {sampling.max_tokens}")
    temperature = sampling.temperature if sampling.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"sampling.temperature must be >= 0, got {temperature}")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"sampling.top_p must be in (0, 1], got {top_p}")
    top_k = sampling.top_k if sampling.HasField("top_k") else 0
    if top_k < 0:
        raise RequestError(f"sampling.top_k must be >= 0, got {top_k}")
    logprobs = sampling.logprobs if sampling.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise RequestError(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    try:
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=sampling.seed if sampling.HasField("seed") else None,
            ignore_eos=sampling.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise RequestError(f"sampling: {exc}") from None


def _stop_strings(sampling: generation_pb2.SamplingOptions) -> tuple[str, ...]:
    stop = tuple(sampling.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"sampling.stop holds {len(stop)} strings, at most {MAX_STOP_STRINGS}")
    if any(not s for s in stop):
        raise RequestError("sampling.stop must not contain empty strings")
    return stop


def parse_transfer_params(text: str, *, required: bool = False) -> dict[str, Any] | None:
    """``kv_transfer_params_json`` as a dict; ``None`` when empty and not ``required``."""
    if not text:
        if required:
            raise RequestError("kv_transfer_params_json must not be empty")
        return None
    try:
        params = json.loads(text)
    except RecursionError:
        raise RequestError("kv_transfer_params_json is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise RequestError(f"kv_transfer_params_json is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise RequestError(
            f"kv_transfer_params_json must be a JSON object, got {type(params).__name__}"
        )
    return params
