"""OpenTelemetry traces of requests' timelines (`kvtransfer.timeline`), sent over OTLP.

The router owns the export: it holds every span of a request (its own, and the daemons' from
their final messages), so one trace per choice leaves one process, in the shape vLLM's
``--otlp-traces-endpoint`` gives: a root span ``llm_request`` with vLLM's ``gen_ai.*``
attributes, under the caller's W3C ``traceparent`` when one came with the HTTP request. Below it
the router's spans (``router.*``); each daemon's spans hang under the router's call to that
daemon (``router.prefill_call``, ``router.decode_call``), named ``prefill.*`` / ``decode.*``.

Spans are handed to the SDK's batch processor: a background thread exports them, a collector
that is down or slow costs dropped spans (the SDK's bounded queue), never a request's time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvtransfer.timeline import AttributeValue, Span

# Which router span a daemon's spans belong under.
_CALL_OF_PROCESS = {"prefill": "prefill_call", "decode": "decode_call"}


@dataclass(frozen=True)
class RequestTrace:
    """One choice's trace: its root's name, times and attributes, and its spans."""

    request_id: str
    start_ns: int
    end_ns: int
    spans: Sequence[Span]
    attributes: Mapping[str, AttributeValue]
    traceparent: str | None = None


class TraceExporter:
    """Turns `RequestTrace` s into OpenTelemetry spans exported over OTLP/gRPC."""

    def __init__(
        self,
        endpoint: str,
        service_name: str = "kvtransfer-router",
        insecure: bool = True,
        exporter: SpanExporter | None = None,
    ) -> None:
        if not endpoint and exporter is None:
            raise ValueError("an OTLP traces endpoint (host:port or URL) is required")
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("kvtransfer")
        self._propagator = TraceContextTextMapPropagator()

    def export(self, request: RequestTrace) -> None:
        parent = None
        if request.traceparent:
            parent = self._propagator.extract({"traceparent": request.traceparent})
        root = self._tracer.start_span(
            "llm_request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=request.start_ns,
            attributes={"gen_ai.request.id": request.request_id, **request.attributes},
        )
        root_context = trace.set_span_in_context(root)
        calls: dict[str, Context] = {}
        daemon_spans = []
        for span in request.spans:
            if span.process and span.process != "router":
                daemon_spans.append(span)
                continue
            child = self._start(span, root_context)
            if span.name in _CALL_OF_PROCESS.values() and span.name not in calls:
                calls[span.name] = trace.set_span_in_context(child)
            child.end(end_time=span.end_ns)
        for span in daemon_spans:
            parent_context = calls.get(_CALL_OF_PROCESS.get(span.process, ""), root_context)
            self._start(span, parent_context).end(end_time=span.end_ns)
        root.end(end_time=request.end_ns)

    def _start(self, span: Span, context: Context) -> trace.Span:
        return self._tracer.start_span(
            span.qualified_name(),
            context=context,
            start_time=span.start_ns,
            attributes=dict(span.attributes),
        )

    def shutdown(self) -> None:
        """Export what is queued (bounded by the SDK's timeout), then stop."""
        self._provider.shutdown()
