"""One choice on the daemons, as the runner keeps it: its state (`Exchange`), its token stream
accumulated from the daemons' messages (`Decoded`), and what it adds to the answer (`Delta`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.router.errors import UpstreamError
from kvtransfer.router.openai.requests import Choice
from kvtransfer.router.routing.disagg import RouteDecision
from kvtransfer.router.routing.policy import RouteContext
from kvtransfer.v1 import generation_pb2

# Decode outcomes after which the decode engine has pulled, or let go of, the prefill's KV.
CLEAN_FINISHES = frozenset({"length", "stop"})


@dataclass(frozen=True)
class Delta:
    """What one choice adds to the answer: text, its tokens and their log-probabilities; the
    choice's last delta has a ``finish_reason``, the ``kvtransfer`` object and the prompt's
    token count."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[generation_pb2.OutputLogprobs, ...] = ()
    finish_reason: str | None = None
    info: dict[str, Any] | None = None
    num_prompt_tokens: int = 0
    # On the last delta: prompt tokens no engine computed for this request (a prefix-cache hit).
    num_cached_tokens: int = 0


@dataclass
class Exchange:
    """One choice's state: ``request_id`` is the id both daemons know it by."""

    request_id: str
    choice: Choice
    started: float
    deadline: float
    log: logging.LoggerAdapter[logging.Logger]
    # What the policies see of it: its id, and its prompt's token ids when known.
    context: RouteContext
    route: dict[str, str] = field(default_factory=dict)
    # Set once the decode stream ended with "length" or "stop": its KV load is settled.
    decoded: bool = False
    # The client's W3C trace context (its ``traceparent`` header): the trace's parent.
    traceparent: str | None = None
    # P/D or one instance alone, and why (`routing.disagg.decide`); None until decided.
    decision: RouteDecision | None = None


@dataclass
class Decoded:
    """The choice's token stream, accumulated."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    first_token_at: float | None = None
    second_token_at: float | None = None
    final: generation_pb2.GenerateResponse | None = None
    # The prefill's final message (its metrics are the prefill's phases).
    prefill: generation_pb2.GenerateResponse | None = None

    def seed(self, first: generation_pb2.GenerateResponse) -> None:
        """Start from the prefill's final message: the first token, its text, the prompt size
        (a decode stream then continues it; when the first token ended the request, it is
        also the final message)."""
        self.prefill = first
        self.first_token_at = time.monotonic() if first.token_ids else None
        self.token_ids.extend(first.token_ids)
        self.texts.append(first.text)
        self.num_prompt_tokens = first.num_prompt_tokens

    def absorb(self, reply: generation_pb2.GenerateResponse) -> bool:
        """Adds ``reply``; False when it came after the final message (ignored: streams are
        read to their end rather than left at the final message, so the call ends on its own
        instead of being cancelled)."""
        if self.final is not None:
            return False
        if reply.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        elif reply.token_ids and self.second_token_at is None:
            self.second_token_at = time.monotonic()
        self.token_ids.extend(reply.token_ids)
        self.texts.append(reply.text)
        if reply.num_prompt_tokens:
            self.num_prompt_tokens = reply.num_prompt_tokens
        if reply.finished:
            self.final = reply
        return True

    def cached_prompt_tokens(self) -> int:
        """Prompt tokens served from a prefix cache instead of computed: the prefill's hit when
        a prefill computed the prompt (the KV a decode then pulls was computed, not cached),
        else the decode's own (a request that skipped the prefill hop)."""
        for message in (self.prefill, self.final):
            if message is not None and message.HasField("metrics"):
                return int(message.metrics.num_cached_tokens)
        return 0

    def phases(self) -> dict[str, float]:
        """Where the time went, in seconds: each daemon's own measurements, joined, plus the
        first-to-second token gap this router saw (absent phases are left out)."""
        phases: dict[str, float] = {}
        if self.prefill is not None and self.prefill.HasField("metrics"):
            phases["prefill_queue_s"] = self.prefill.metrics.queue_s
            phases["prefill_compute_s"] = self.prefill.metrics.compute_s
        final = self.final
        if final is not None and final is not self.prefill and final.HasField("metrics"):
            phases["decode_queue_s"] = final.metrics.queue_s
            phases["kv_transfer_s"] = final.metrics.kv_transfer_s
            phases["kv_overlapped_s"] = final.metrics.kv_overlapped_s
            phases["decode_first_step_s"] = final.metrics.compute_s
        if self.first_token_at is not None and self.second_token_at is not None:
            phases["second_token_s"] = self.second_token_at - self.first_token_at
        return phases

    @property
    def clean(self) -> bool:
        return self.final is not None and self.final.finish_reason in CLEAN_FINISHES

    def failure(self, address: str) -> UpstreamError | None:
        if self.final is None:
            message = "the stream ended without a final message"
            return UpstreamError(502, message, "decode", address, "incomplete_stream")
        if self.final.finish_reason == "error":
            message = self.final.error or "finished with an error"
            return UpstreamError(502, message, "decode", address, "finish_error")
        return None


def message_delta(exchange: Exchange, message: generation_pb2.GenerateResponse) -> Delta:
    return Delta(
        index=exchange.choice.index,
        text=message.text,
        token_ids=tuple(message.token_ids),
        logprobs=tuple(message.logprobs),
    )
