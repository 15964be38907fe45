"""`GenerationClient`: a synchronous client of a daemon's Generation service (tests, tools)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvtransfer.timeline import Span
from kvtransfer.v1 import generation_pb2, generation_pb2_grpc


def spans_to_proto(spans: Sequence[Span]) -> list[generation_pb2.Span]:
    """A daemon's timeline for its final message; attribute values travel as JSON so their
    types (ints, bools) survive."""
    return [
        generation_pb2.Span(
            name=span.name,
            start_unix_nano=span.start_ns,
            end_unix_nano=span.end_ns,
            attributes={key: json.dumps(value) for key, value in span.attributes.items()},
        )
        for span in spans
    ]


def spans_from_proto(messages: Sequence[generation_pb2.Span], process: str) -> list[Span]:
    """The spans of a daemon's final message, tagged with ``process`` (its role); a value
    that is not JSON is kept as its text."""
    spans = []
    for message in messages:
        attributes: dict[str, Any] = {}
        for key, raw in message.attributes.items():
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            attributes[key] = value if isinstance(value, str | int | float | bool) else raw
        spans.append(
            Span(message.name, message.start_unix_nano, message.end_unix_nano, attributes, process)
        )
    return spans


@dataclass
class GenerateResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    kv_transfer_params: dict[str, Any] | None = None
    num_prompt_tokens: int = 0
    metrics: generation_pb2.RequestMetrics | None = None
    num_messages: int = 0
    logprobs: list[generation_pb2.OutputLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)


def generate_request(
    request_id: str,
    prompt: str | Sequence[int] | generation_pb2.ChatPrompt,
    max_tokens: int,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingOptions(
        max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos
    )
    if logprobs is not None:
        sampling.logprobs = logprobs
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    message = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        message.text = prompt
    elif isinstance(prompt, generation_pb2.ChatPrompt):
        message.chat.CopyFrom(prompt)
    else:
        message.token_ids.ids.extend(prompt)
    if kv_transfer_params is not None:
        message.kv_transfer_params_json = json.dumps(kv_transfer_params)
    return message


class GenerationClient:
    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=list(options))
        else:
            self._channel = grpc.secure_channel(target, credentials, options=list(options))
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def stream(
        self, request: generation_pb2.GenerateRequest, timeout_s: float = 60.0
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """The raw stream (cancel it to abort the request)."""
        return self._stub.Generate(request, timeout=timeout_s)

    def generate(
        self, request: generation_pb2.GenerateRequest, timeout_s: float = 60.0
    ) -> GenerateResult:
        """Collect the whole stream; gRPC errors propagate as `grpc.RpcError`."""
        result = GenerateResult(request.request_id)
        for message in self._stub.Generate(request, timeout=timeout_s):
            result.num_messages += 1
            result.token_ids.extend(message.token_ids)
            result.text += message.text
            result.logprobs.extend(message.logprobs)
            result.prompt_token_ids.extend(message.prompt_token_ids)
            if message.num_prompt_tokens:
                result.num_prompt_tokens = message.num_prompt_tokens
            if message.finished:
                result.finish_reason = message.finish_reason
                result.error = message.error
                if message.kv_transfer_params_json:
                    result.kv_transfer_params = json.loads(message.kv_transfer_params_json)
                result.metrics = message.metrics
        return result

    def release_kv(
        self, request_id: str, kv_transfer_params: dict[str, Any] | str, timeout_s: float = 10.0
    ) -> bool:
        """``Generation.ReleaseKV``: give back the KV a prefill holds for ``request_id``;
        params as the prefill returned them (a dict, or its JSON text sent verbatim)."""
        if not isinstance(kv_transfer_params, str):
            kv_transfer_params = json.dumps(kv_transfer_params)
        request = generation_pb2.ReleaseKVRequest(
            request_id=request_id, kv_transfer_params_json=kv_transfer_params
        )
        return self._stub.ReleaseKV(request, timeout=timeout_s).released

    def continue_request(
        self, request_id: str, generated_token_ids: Sequence[int], timeout_s: float = 10.0
    ) -> None:
        """``Generation.Continue``: the first tokens of a request started with
        ``await_generated_tokens`` (none: it computes its first token itself)."""
        request = generation_pb2.ContinueRequest(
            request_id=request_id, generated_token_ids=list(generated_token_ids)
        )
        self._stub.Continue(request, timeout=timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
