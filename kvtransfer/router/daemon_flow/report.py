"""What a choice reports once it ends: its last `Delta` (finish reason, the ``kvtransfer``
object with route, timings and timeline), the metrics of its phases and cache prediction, and
its timeline as a trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvtransfer.clients.generation import spans_from_proto
from kvtransfer.router.daemon_flow.exchange import Decoded, Delta, Exchange
from kvtransfer.router.metrics import RouterMetrics
from kvtransfer.router.tracing import RequestTrace, TraceExporter
from kvtransfer.timeline import BOOK, Span, now_ns, relative, wall_ns
from kvtransfer.v1 import generation_pb2


class ChoiceReport:
    """Builds a choice's last delta, and records its metrics and trace."""

    def __init__(self, metrics: RouterMetrics, traces: TraceExporter | None) -> None:
        self.metrics = metrics
        self.traces = traces

    def last(
        self,
        exchange: Exchange,
        decoded: Decoded,
        final: generation_pb2.GenerateResponse,
        text: str,
    ) -> Delta:
        self.metrics.phases(decoded.phases())
        spans = self._timeline(exchange, decoded)
        cached = decoded.cached_prompt_tokens()
        role = "decode" if decoded.prefill is None else "prefill"
        predicted = exchange.context.predicted_cached_tokens.get(role)
        if predicted is not None:
            self.metrics.cache_prediction(role, predicted, cached)
        exchange.log.info(
            "done (%s): %d tokens, %d KV blocks received, %.1f ms",
            final.finish_reason,
            len(decoded.token_ids),
            final.metrics.kv_blocks_received,
            (time.monotonic() - exchange.started) * 1e3,
        )
        return Delta(
            index=exchange.choice.index,
            text=text,
            token_ids=tuple(final.token_ids),
            logprobs=tuple(final.logprobs),
            finish_reason=final.finish_reason,
            info=_kvtransfer_info(exchange, decoded, spans),
            num_prompt_tokens=decoded.num_prompt_tokens,
            num_cached_tokens=cached,
        )

    def _timeline(self, exchange: Exchange, decoded: Decoded) -> list[Span]:
        """The choice's spans, this router's and its daemons', as the answer, the span
        histograms and the trace exporter get them."""
        spans = [replace(span, process="router") for span in BOOK.take(exchange.request_id)]
        if decoded.prefill is not None:
            spans += spans_from_proto(decoded.prefill.spans, "prefill")
        if decoded.final is not None and decoded.final is not decoded.prefill:
            spans += spans_from_proto(decoded.final.spans, "decode")
        self.metrics.spans(spans)
        if self.traces is not None:
            trace = RequestTrace(
                exchange.request_id,
                wall_ns(exchange.started),
                now_ns(),
                spans,
                _trace_attributes(exchange, decoded),
                exchange.traceparent,
            )
            # After this delta is written: the SDK's span objects cost the loop some time.
            asyncio.get_running_loop().call_soon(self.traces.export, trace)
        return spans


def _trace_attributes(exchange: Exchange, decoded: Decoded) -> dict[str, Any]:
    """vLLM's ``gen_ai.*`` attributes of its ``llm_request`` span, where the router knows
    them, and the route."""
    attributes: dict[str, Any] = {
        "gen_ai.usage.prompt_tokens": decoded.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": len(decoded.token_ids),
        "gen_ai.request.max_tokens": exchange.choice.max_tokens,
    }
    if decoded.first_token_at is not None:
        attributes["gen_ai.latency.time_to_first_token"] = decoded.first_token_at - exchange.started
    if decoded.final is not None:
        attributes["gen_ai.response.finish_reasons"] = (decoded.final.finish_reason,)
    attributes.update({f"kvtransfer.{role}": address for role, address in exchange.route.items()})
    return attributes


def _kvtransfer_info(exchange: Exchange, decoded: Decoded, spans: Sequence[Span]) -> dict[str, Any]:
    metrics = decoded.final.metrics if decoded.final is not None else None
    first = decoded.first_token_at
    origin = wall_ns(exchange.started)
    return {
        "request_id": exchange.request_id,
        **exchange.route,
        "token_ids": list(decoded.token_ids),
        "ttft_s": None if first is None else first - exchange.started,
        "kv_transfer_s": metrics.kv_transfer_s if metrics is not None else 0.0,
        "kv_blocks_received": metrics.kv_blocks_received if metrics is not None else 0,
        "kv_bytes_received": metrics.kv_bytes_received if metrics is not None else 0,
        "num_recomputed_tokens": metrics.num_recomputed_tokens if metrics is not None else 0,
        # The policy's expectation at the pick (None: no prefix index, or prompt tokens
        # unknown), for the role that computed the prompt.
        "predicted_cached_tokens": exchange.context.predicted_cached_tokens.get(
            "decode" if decoded.prefill is None else "prefill"
        ),
        "phases": decoded.phases(),
        # P/D or one instance alone, the rule's reason and its predictions (an aggregated
        # instance the decode policy picked runs alone whatever was decided).
        "route_decision": None if exchange.decision is None else exchange.decision.describe(),
        # Where each millisecond went: every span, in ms from the request's arrival here
        # (that instant as wall-clock ns, to line a client's own times up with them).
        "timeline": relative(spans, origin),
        "timeline_origin_unix_ns": origin,
    }
