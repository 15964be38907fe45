"""Request timelines: the book's bounds, and one P/D request through real daemons and the router
whose answer, Prometheus series and OpenTelemetry trace (received by a real OTLP/gRPC
collector listening on 127.0.0.1) all tell where its time went, span by span."""

from __future__ import annotations

import itertools
import json
import queue
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from serve_helpers.daemons import colocated, daemon_pair, running, start_router
from serve_helpers.probes import get

from kvtransfer.timeline import BOOK, Span, TimelineBook, relative, wall_clock

# A W3C trace context as a client would send it: the trace must continue under it.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
# 40 tokens: three blocks of 16, so the prefill streams its layers to an early decode.
PROMPT = [(7 * i) % 200 + 30 for i in range(40)]
MAX_TOKENS = 6
NUM_LAYERS = 4  # builtin:tiny


# ---------------------------------------------------------------------- the book


@pytest.mark.unit
def test_book_keeps_spans_per_request_in_start_order_and_forgets_taken_ones():
    book = TimelineBook()
    book.record("a", "late", 30, 40)
    book.record("a", "early", 10, 20, layer="model.layers.0")
    book.record("b", "other", 0, 1)
    assert [s.name for s in book.take("a")] == ["early", "late"]
    assert book.take("a") == []
    assert [s.name for s in book.take("b")] == ["other"]
    assert len(book) == 0


@pytest.mark.unit
def test_book_is_bounded_in_requests_and_spans_per_request():
    book = TimelineBook(max_requests=2, max_spans=3)
    for i in range(5):
        book.record("a", f"s{i}", i, i + 1)
    book.record("b", "x", 0, 1)
    book.record("c", "y", 0, 1)  # evicts "a", the oldest request
    assert book.take("a") == []
    assert [s.name for s in book.take("c")] == ["y"]
    assert book.dropped == 2 + 1  # two spans over a's limit, then a itself
    with pytest.raises(ValueError, match="max_requests and max_spans must be >= 1"):
        TimelineBook(max_requests=0)


@pytest.mark.unit
def test_span_context_records_failures_and_rows_are_relative_ms():
    book = TimelineBook()
    with pytest.raises(KeyError), book.span("r", "lookup", table="t"):
        raise KeyError("x")
    (span,) = book.take("r")
    assert span.attributes == {"table": "t", "error": "KeyError"}
    spans = [Span("engine.compute", 3_000_000, 5_500_000, {"n": 1}, "prefill")]
    assert relative(spans, 1_000_000) == [
        {
            "name": "prefill.engine.compute",
            "start_ms": 2.0,
            "duration_ms": 2.5,
            "attributes": {"n": 1},
        }
    ]


@pytest.mark.unit
def test_instants_converted_by_one_wall_clock_keep_their_order_and_gaps():
    # A request's queue and compute phases share an instant (scheduled); converting each
    # reading with its own pair of clock reads could put the later phase first.
    to_wall = wall_clock()
    scheduled = time.monotonic()
    assert to_wall(scheduled) == to_wall(scheduled)
    assert to_wall(scheduled + 0.25) - to_wall(scheduled) == pytest.approx(250_000_000, abs=1)


@pytest.mark.unit
def test_a_request_puts_its_first_steps_on_its_timeline_and_no_more():
    from kvtransfer.engine.sampling_params import SamplingParams
    from kvtransfer.engine.scheduler.request import TIMELINE_STEPS, Request

    request = Request("steps", (1, 2, 3), SamplingParams(max_tokens=64), seed=0)
    request.first_scheduled_at = request.arrived_at = time.monotonic()
    for _ in range(TIMELINE_STEPS + 5):
        request.record_sampled(1)
    request.record_sampled(3)  # a step that accepted drafts
    spans = BOOK.take("steps")
    assert [s.name for s in spans[:2]] == ["engine.queue", "engine.compute"]
    steps = spans[2:]
    assert [s.attributes["step"] for s in steps] == list(range(1, TIMELINE_STEPS + 1))
    assert all(s.name == "engine.step" and s.attributes["tokens"] == 1 for s in steps)
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(steps))


# ---------------------------------------------------------------------- end to end


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every exported request lands in ``received``."""

    def __init__(self) -> None:
        self.received: queue.Queue[trace_service_pb2.ExportTraceServiceRequest] = queue.Queue()

    def Export(self, request, context):
        self.received.put(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def _stream(base_url: str, prompt: list[int]) -> tuple[list[int], dict]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = response.read().decode().split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    info = chunks[-1]["kvtransfer"]
    return info["token_ids"], info


def _spans_by_name(timeline: list[dict]) -> dict[str, list[dict]]:
    named: dict[str, list[dict]] = {}
    for row in timeline:
        named.setdefault(row["name"], []).append(row)
    return named


def _end(row: dict) -> float:
    return row["start_ms"] + row["duration_ms"]


def _trace_spans(collector: _Collector, want: int) -> list:
    """Spans the collector got, waiting for the batch processor's flush (0.5 s)."""
    spans: list = []
    while len(spans) < want:
        exported = collector.received.get(timeout=30)
        for resource in exported.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
    return spans


@pytest.mark.integration
def test_a_pd_request_shows_each_phase_in_its_answer_metrics_and_trace(tmp_path, collector):
    servicer, endpoint = collector
    (expected,) = colocated([PROMPT], MAX_TOKENS)
    with daemon_pair(tmp_path, (), ()) as (prefill, decode):
        router = start_router(tmp_path, [prefill], [decode], "--otlp-traces-endpoint", endpoint)
        with running(router):
            tokens, info = _stream(router.address, PROMPT)
            assert tokens == expected
            status, metrics_text = get(router.address, "/metrics")
    assert status == 200
    timeline = info["timeline"]
    named = _spans_by_name(timeline)

    # Every process's phases, in the order a P/D request runs them.
    for name in (
        "router.parse",
        "router.admit",
        "router.prefill_call",
        "router.decode_call",
        "router.first_token_out",
        "prefill.admit",
        "prefill.engine.queue",
        "prefill.engine.compute",
        "prefill.first_token_out",
        "decode.admit",
        # The first request from this producer: a handshake, then the one-sided keys.
        "decode.kv.handshake",
        "decode.kv.keys",
        "decode.engine.kv_wait",
        "decode.engine.compute",
    ):
        assert name in named, (name, sorted(named))
    assert [row["attributes"]["role"] for row in named["router.pick"]] == ["decode", "prefill"]
    # One span per layer computed and saved (streamed) by the prefill, layers in order.
    layers = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
    assert [r["attributes"]["layer"] for r in named["prefill.model.layer"]] == layers
    assert [r["attributes"]["layer"] for r in named["prefill.kv.save_layer"]] == layers
    # The decode read what it reports having received, one-sided, layer by layer.
    reads = named["decode.kv.read"]
    assert sum(r["attributes"]["bytes"] for r in reads) == info["kv_bytes_received"] > 0
    assert all(r["attributes"]["one_sided"] is True for r in reads)
    assert sum(r["attributes"]["layers"] for r in reads) == NUM_LAYERS
    # The prefill sampled the first token, the decode's first step the second; each later
    # token is a step of its own, back to back.
    steps = named["decode.engine.step"]
    assert [row["attributes"]["step"] for row in steps] == list(range(1, MAX_TOKENS - 1))
    for before, after in itertools.pairwise(steps):
        assert after["start_ms"] == pytest.approx(_end(before), abs=0.002)
    # The daemons' spans lie inside the router's calls to them (one host: one clock).
    (prefill_call,) = named["router.prefill_call"]
    (compute,) = named["prefill.engine.compute"]
    assert prefill_call["start_ms"] <= compute["start_ms"] <= _end(compute) <= _end(prefill_call)
    (decode_call,) = named["router.decode_call"]
    for row in named["decode.engine.kv_wait"] + reads:
        assert decode_call["start_ms"] <= row["start_ms"] <= _end(row) <= _end(decode_call)
    # The first token left the router after the prefill sampled it, before the decode's.
    (first_out,) = named["router.first_token_out"]
    assert _end(compute) <= first_out["start_ms"] <= _end(named["decode.engine.compute"][0])

    # Prometheus: a histogram series per span name, this request counted once in each.
    for name in ("router.prefill_call", "prefill.engine.compute", "decode.kv.read"):
        count = len(named[name])
        assert f'kvtransfer_router_span_seconds_count{{span="{name}"}} {count}.0' in metrics_text

    # OpenTelemetry: one trace under the client's trace context, the daemons' spans under the
    # router's call to each.
    spans = _trace_spans(servicer, want=len(timeline) + 1)
    assert {span.trace_id.hex() for span in spans} == {TRACE_ID}
    (root,) = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id.hex() == PARENT_SPAN_ID
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.request.id"].string_value == info["request_id"]
    assert attributes["gen_ai.usage.completion_tokens"].int_value == MAX_TOKENS
    by_name = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == sorted({"llm_request", *named})
    (prefill_call_span,) = by_name["router.prefill_call"]
    (decode_call_span,) = by_name["router.decode_call"]
    assert prefill_call_span.parent_span_id == root.span_id
    for span in by_name["prefill.model.layer"]:
        assert span.parent_span_id == prefill_call_span.span_id
    for span in by_name["decode.kv.read"]:
        assert span.parent_span_id == decode_call_span.span_id


@pytest.mark.unit
def test_the_exporter_refuses_no_endpoint():
    from kvtransfer.router.tracing import TraceExporter

    with pytest.raises(ValueError, match="OTLP traces endpoint"):
        TraceExporter("")


@pytest.mark.unit
def test_spans_survive_the_wire_with_their_types():
    from kvtransfer.clients.generation import spans_from_proto, spans_to_proto

    spans = [Span("kv.read", 1, 2, {"bytes": 4096, "one_sided": True, "layer": "l0", "x": 0.5})]
    (back,) = spans_from_proto(spans_to_proto(spans), "decode")
    assert back == Span("kv.read", 1, 2, dict(spans[0].attributes), "decode")
