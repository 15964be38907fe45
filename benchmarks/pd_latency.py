"""P/D latency: what disaggregation costs a single request, against a colocated daemon.

    .venv/bin/python benchmarks/pd_latency.py [--quick] [--data-planes rma push] [--netns]
        [--json out.json]

For each model (``builtin`` and ``builtin:small`` by default; the processes are restarted per
model) two setups run as real processes on 127.0.0.1, every port picked by the OS (``--port 0``):

- colocated: one daemon whose engine serves the whole request. A daemon always loads a
  connector, so it gets the no-op one (`KVConnectorBase_V1` itself: every hook runs and does
  nothing). ``Generate`` is streamed to it directly over gRPC.
- P/D: a prefill and a decode daemon (UcxConnector, as ``kvtransfer-prefill`` /
  ``kvtransfer-decode`` default to) behind the router; ``/v1/completions`` with ``stream`` and a
  token-id prompt. The router streams the prefill's first token at once, then the decode
  daemon pulls the prompt's KV and continues after it.

``--data-planes``: the P/D pair once per plane named (fresh processes each, the colocated
baseline measured again beside each), one table. ``--netns`` (root): the prefill, the decode and
the router each in a network namespace of its own (the test tier's hosts, as ``chaos.py
--netns``), so the KV crosses TCP as between hosts; the colocated daemon stays here.

One request at a time, colocated and P/D alternating so that both see the same background load
(an idle daemon costs no CPU); run it on an otherwise idle machine all the same. Every request
is a fresh random prompt of printable byte ids (no prefix-cache hit), greedy, ``max_tokens`` 8;
each setup first runs one warm-up request per prompt length (the first P/D request also pays
the UCX handshake). Per (model, prompt length) the medians of N requests:

- ``colocated_ttft_ms``: request sent until the first streamed token; ``colocated_itl_ms``: the
  median gap between consecutive streamed tokens (a gap over a message of k tokens counts /k);
- ``pd_ttft_ms``: request sent until the first SSE chunk with text (the prefill's token);
  ``pd_second_token_ms``: first chunk until the second (decode call, KV pull, first decode
  step); ``pd_itl_ms``: median gap between the chunks after that;
- ``colocated_daemon_ttft_ms`` / ``pd_router_ttft_ms`` (JSON): the same, as the daemon (its
  ``ttft_s``, from admission) and the router (from the request's arrival) saw it; minimum
  TTFTs too, which other work on the machine disturbs less than the medians;
- from the final chunk's ``kvtransfer`` object: ``transfer_ms`` (``kv_transfer_s``: the decode
  daemon's wait for remote KV) and ``overlapped_ms`` (``kv_overlapped_s``, transfer hidden
  behind the producer's compute; 0 where the router does not report it), ``first_step_ms``
  likewise, and the KV bytes received.

A prompt that does not fit a model (prompt + max_tokens over its max_model_len, or a daemon
refusing it) is skipped with the reason printed. Every process is stopped at the end, also on
an error or Ctrl-C; their logs are kept (and named) when something failed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from chaos import Placement, make_namespaces
from plots import write_png

from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.engine.model.loader import load_model_config
from kvtransfer.serve.launcher import (
    ServiceProcess,
    ServiceStartError,
    daemon_command,
    router_command,
)

MODELS = ("builtin", "builtin:small")
# The long case is 2040, not 2048: the built-in models have 2048 positions, and the prompt must
# leave room for the generated tokens.
LENGTHS = (16, 128, 512, 2040)
QUICK_LENGTHS = (16, 512, 2040)
MAX_TOKENS = 8
BLOCK_SIZE = 16
REQUEST_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# A request whose first token ends it (end of sequence) has no second token: another prompt.
ATTEMPTS_PER_SAMPLE = 3
PRINTABLE_IDS = range(32, 127)
NOOP_CONNECTOR = {
    "kv_connector": "KVConnectorBase_V1",
    "kv_connector_module_path": "kvtransfer.connector.base",
    "kv_role": "kv_both",
}


class CaseSkipped(Exception):
    """The daemons refused this prompt length (the message says why)."""


class BenchError(RuntimeError):
    """A request failed in a way that says the setup is broken."""


def sse_chunks(response: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI event stream, up to ``[DONE]``; an error chunk raises."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise BenchError(f"router stream error: {chunk['error']}")
        yield chunk


@dataclass
class Sample:
    """One request: milliseconds, ``None`` where it did not apply."""

    ttft_ms: float
    server_ttft_ms: float  # colocated: the daemon's own ttft_s; P/D: the router's
    next_ms: float | None  # colocated: ITL; P/D: first chunk to second
    itl_ms: float | None = None  # P/D: gaps after the second chunk
    transfer_ms: float = 0.0
    overlapped_ms: float = 0.0
    first_step_ms: float = 0.0
    kv_bytes: int = 0
    overlap_reported: bool = False
    # Where the time to the first token went (`ttft_segments`), ms per segment.
    segments: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------ processes


def daemon(
    role: str,
    model: str,
    name: str,
    kv: dict[str, Any],
    num_kv_blocks: int,
    log_dir: Path,
    where: tuple[list[str], str] = ([], "127.0.0.1"),
) -> ServiceProcess:
    """``where``: the command prefix that puts it in its namespace, and its address there."""
    prefix, host = where
    argv = prefix + daemon_command(
        role,
        "--model",
        model,
        "--host",
        host,
        "--port",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-kv-blocks",
        str(num_kv_blocks),
        "--kv-transfer-config",
        json.dumps(kv),
    )
    return ServiceProcess.start(name, argv, log_dir / f"{name}.log")


@contextlib.contextmanager
def setups(
    model: str,
    num_kv_blocks: int,
    log_dir: Path,
    router_flags: Sequence[str] = (),
    data_plane: str = "rma",
    placement: Placement | None = None,
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """(the colocated daemon, the router in front of a prefill and a decode daemon on
    ``data_plane``); every process started is stopped on the way out, whatever happened.
    ``placement``: the prefill, the decode and the router each in its network namespace (the
    colocated daemon stays here, on 127.0.0.1)."""
    tag = f"{model.replace(':', '-')}-{data_plane}"
    started: list[ServiceProcess] = []

    def where(role: str) -> tuple[list[str], str]:
        if placement is None:
            return [], "127.0.0.1"
        return placement.wrap[role], placement.hosts[role]

    def start(role: str, name: str, kv: dict[str, Any], placed: str | None = None) -> str:
        at = where(placed) if placed else ([], "127.0.0.1")
        started.append(daemon(role, model, f"{name}-{tag}", kv, num_kv_blocks, log_dir, at))
        return started[-1].address

    def ucx(role: str) -> dict[str, Any]:
        extra = {"data_plane": data_plane}
        return {"kv_ip": where(role)[1], "kv_port": 0, "kv_connector_extra_config": extra}

    try:
        start("decode", "colocated", NOOP_CONNECTOR)
        prefix, host = where("router")
        flags = ["--host", host, "--port", "0"]
        flags += ["--prefill", start("prefill", "prefill", ucx("prefill"), "prefill")]
        flags += ["--decode", start("decode", "decode", ucx("decode"), "decode"), *router_flags]
        name = f"router-{tag}"
        argv = prefix + router_command(*flags)
        started.append(ServiceProcess.start(name, argv, log_dir / f"{name}.log"))
        yield started[0], started[-1]
    finally:
        for process in reversed(started):
            process.terminate(STOP_TIMEOUT_S)


# ------------------------------------------------------------------ the TTFT's path

# The segments of a first token's way, in order, on both setups (a segment a setup does not
# have is left out of its row): the client's request to the first process, the router's own
# work and hops (P/D), the engine's admission, queue and compute, the sampled token to its
# stream, its way back.
SEGMENTS = (
    "client_to_first_hop",
    "router_before_prefill",
    "router_to_prefill",
    "admit",
    "queue",
    "compute",
    "token_to_stream",
    "prefill_to_router",
    "router_first_token_out",
    "to_client",
)


def _spans(rows: Sequence[dict[str, Any]], origin_ns: int) -> dict[str, tuple[int, int]]:
    """First span of each name as (start, end) wall ns."""
    spans: dict[str, tuple[int, int]] = {}
    for row in rows:
        start = origin_ns + int(row["start_ms"] * 1e6)
        spans.setdefault(row["name"], (start, start + int(row["duration_ms"] * 1e6)))
    return spans


def ttft_segments(
    sent_ns: int, first_ns: int, spans: dict[str, tuple[int, int]], daemon: str, pd: bool
) -> dict[str, float]:
    """The first token's path in ms: each segment from the end of the one before, so that
    they add up to the client's TTFT (one host: the processes share a clock)."""
    marks = [("client_to_first_hop", spans["router.parse" if pd else f"{daemon}.admit"][0])]
    if pd:
        marks += [
            ("router_before_prefill", spans["router.prefill_call"][0]),
            ("router_to_prefill", spans[f"{daemon}.admit"][0]),
        ]
    marks += [
        ("admit", spans[f"{daemon}.engine.queue"][0]),
        ("queue", spans[f"{daemon}.engine.compute"][0]),
        ("compute", spans[f"{daemon}.engine.compute"][1]),
        ("token_to_stream", spans[f"{daemon}.first_token_out"][1]),
    ]
    if pd:
        marks += [
            ("prefill_to_router", spans["router.prefill_call"][1]),
            ("router_first_token_out", spans["router.first_token_out"][1]),
        ]
    marks.append(("to_client", first_ns))
    segments, previous = {}, sent_ns
    for name, at in marks:
        segments[name] = (at - previous) / 1e6
        previous = at
    return segments


# ------------------------------------------------------------------ requests


def colocated_request(client: GenerationClient, prompt: list[int]) -> Sample | None:
    """Stream ``Generate``; ``None`` when fewer than two tokens came back."""
    request = generate_request(f"bench-{uuid.uuid4().hex}", prompt, MAX_TOKENS)
    arrivals: list[tuple[float, int]] = []
    server_ttft_s = 0.0
    segments: dict[str, float] = {}
    first_ns = 0
    sent_ns = time.time_ns()
    start = time.perf_counter()
    try:
        for message in client.stream(request, timeout_s=REQUEST_TIMEOUT_S):
            if message.token_ids:
                arrivals.append((time.perf_counter(), len(message.token_ids)))
                first_ns = first_ns or time.time_ns()
            if message.finished:
                if message.finish_reason == "error":
                    raise BenchError(f"colocated request failed: {message.error}")
                server_ttft_s = message.metrics.ttft_s
                spans = {
                    f"colocated.{span.name}": (span.start_unix_nano, span.end_unix_nano)
                    for span in reversed(message.spans)
                }
                segments = ttft_segments(sent_ns, first_ns, spans, "colocated", pd=False)
    except grpc.RpcError as exc:
        refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
        if isinstance(exc, grpc.Call) and exc.code() in refused:
            raise CaseSkipped(f"colocated daemon: {exc.details()}") from None
        raise
    if sum(n for _, n in arrivals) < 2:
        return None
    gaps = [(t - prev) / n for (prev, _), (t, n) in itertools.pairwise(arrivals)]
    return Sample(
        ttft_ms=(arrivals[0][0] - start) * 1e3,
        server_ttft_ms=server_ttft_s * 1e3,
        next_ms=_median_ms(gaps),
        segments=segments,
    )


def pd_request(router_url: str, prompt: list[int]) -> Sample | None:
    """Stream ``/v1/completions``; ``None`` when fewer than two chunks carried text."""
    url = urlsplit(router_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=REQUEST_TIMEOUT_S)
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True})
    chunks: list[float] = []
    info: dict[str, Any] | None = None
    first_ns = 0
    try:
        sent_ns = time.time_ns()
        start = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")[:500]
            if response.status in (400, 413):
                raise CaseSkipped(f"router answered {response.status}: {text}")
            raise BenchError(f"router answered {response.status}: {text}")
        for chunk in sse_chunks(response):
            if chunk["choices"][0].get("text"):
                chunks.append(time.perf_counter())
                first_ns = first_ns or time.time_ns()
            info = chunk.get("kvtransfer") or info
    finally:
        connection.close()
    if info is None:
        raise BenchError("the stream ended without a kvtransfer object")
    if len(chunks) < 2:
        return None
    gaps = [b - a for a, b in itertools.pairwise(chunks[1:])]
    spans = _spans(info["timeline"], info["timeline_origin_unix_ns"])
    # The router joins both daemons' measurements under "phases".
    phases = info.get("phases") or {}
    overlap_reported = "kv_overlapped_s" in phases
    return Sample(
        ttft_ms=(chunks[0] - start) * 1e3,
        server_ttft_ms=float(info.get("ttft_s") or 0.0) * 1e3,
        next_ms=(chunks[1] - chunks[0]) * 1e3,
        itl_ms=_median_ms(gaps) if gaps else None,
        transfer_ms=float(info.get("kv_transfer_s") or 0.0) * 1e3,
        overlapped_ms=float(phases.get("kv_overlapped_s") or 0.0) * 1e3,
        first_step_ms=float(phases.get("decode_first_step_s") or 0.0) * 1e3,
        kv_bytes=int(info.get("kv_bytes_received") or 0),
        overlap_reported=overlap_reported,
        segments=ttft_segments(sent_ns, first_ns, spans, "prefill", pd=True),
    )


def sample(send: Callable[[list[int]], Sample | None], length: int, rng: random.Random) -> Sample:
    """One request with a fresh prompt (another one if it gave fewer than two tokens)."""
    for _ in range(ATTEMPTS_PER_SAMPLE):
        result = send([rng.choice(PRINTABLE_IDS) for _ in range(length)])
        if result is not None:
            return result
    raise BenchError(
        f"{ATTEMPTS_PER_SAMPLE} prompts of {length} tokens in a row gave fewer than two tokens"
    )


def _median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# ------------------------------------------------------------------ the run


def run_model(
    model: str,
    lengths: Sequence[int],
    n: int,
    rng: random.Random,
    log_dir: Path,
    router_flags: Sequence[str] = (),
    data_plane: str = "rma",
    placement: Placement | None = None,
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Every length on one set of processes; colocated and P/D requests alternate, so that
    both see the same background load."""
    max_len = load_model_config(model).max_position_embeddings
    skipped = {
        length: f"{length} prompt + {MAX_TOKENS} output tokens exceed max_model_len {max_len} "
        "(the model's max_position_embeddings)"
        for length in lengths
        if length + MAX_TOKENS > max_len
    }
    # Room for a few of the longest requests: the prefill holds each prompt's KV until pulled.
    longest = max([length for length in lengths if length not in skipped], default=0)
    num_kv_blocks = 4 * math.ceil((longest + MAX_TOKENS) / BLOCK_SIZE)
    rows: list[dict[str, Any]] = []
    if len(skipped) == len(lengths):
        return rows, skipped
    print(f"{model}: starting the daemons and the router ...", file=sys.stderr, flush=True)
    with (
        setups(model, num_kv_blocks, log_dir, router_flags, data_plane, placement) as (
            colocated,
            router,
        ),
        GenerationClient(colocated.address) as client,
    ):
        senders = (
            lambda p: colocated_request(client, p),
            lambda p: pd_request(router.address, p),
        )
        for length in lengths:
            if length in skipped:
                continue
            print(f"{model}: {length}-token prompts ...", file=sys.stderr, flush=True)
            try:
                for send in senders:
                    sample(send, length, rng)  # warm-up
                samples: tuple[list[Sample], list[Sample]] = ([], [])
                for i in range(n):
                    # Alternate which goes first: neither always runs right after the other.
                    for j in (0, 1) if i % 2 == 0 else (1, 0):
                        samples[j].append(sample(senders[j], length, rng))
            except CaseSkipped as exc:
                skipped[length] = str(exc)
                continue
            where = "netns" if placement is not None else "local"
            rows.append(
                {**summarize(model, length, *samples), "data_plane": data_plane, "hosts": where}
            )
    return rows, skipped


def summarize(model: str, length: int, c: list[Sample], p: list[Sample]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": model,
        "prompt_tokens": length,
        "n": len(c),
        "max_tokens": MAX_TOKENS,
        "colocated_ttft_ms": _median([s.ttft_ms for s in c]),
        "pd_ttft_ms": _median([s.ttft_ms for s in p]),
        # Less sensitive to other work on the machine than the medians.
        "colocated_ttft_min_ms": min(s.ttft_ms for s in c),
        "pd_ttft_min_ms": min(s.ttft_ms for s in p),
        "colocated_daemon_ttft_ms": _median([s.server_ttft_ms for s in c]),
        "pd_router_ttft_ms": _median([s.server_ttft_ms for s in p]),
        "colocated_itl_ms": _median([s.next_ms for s in c]),
        "pd_second_token_ms": _median([s.next_ms for s in p]),
        "pd_itl_ms": _median([s.itl_ms for s in p]),
        "transfer_ms": _median([s.transfer_ms for s in p]),
        "overlapped_ms": _median([s.overlapped_ms for s in p]),
        "first_step_ms": _median([s.first_step_ms for s in p]),
        "kv_bytes": _median([s.kv_bytes for s in p]),
        "overlap_reported": any(s.overlap_reported for s in p),
    }
    row["ttft_breakdown"] = {
        name: {
            "colocated_ms": _median([s.segments.get(name) for s in c]),
            "pd_ms": _median([s.segments.get(name) for s in p]),
        }
        for name in SEGMENTS
    }
    row["ttft_ratio"] = row["pd_ttft_ms"] / row["colocated_ttft_ms"]
    # The goal: P/D within 1.1x colocated + 1 ms.
    row["ttft_goal_ms"] = 1.1 * row["colocated_ttft_ms"] + 1.0
    row["second_token_ratio"] = row["pd_second_token_ms"] / row["colocated_itl_ms"]
    return row


COLUMNS = (
    ("model", "{:<14}"),
    ("data_plane", "{:>10}"),
    ("prompt_tokens", "{:>13}"),
    ("colocated_ttft_ms", "{:>17.1f}"),
    ("pd_ttft_ms", "{:>10.1f}"),
    ("ttft_ratio", "{:>10.2f}"),
    ("colocated_itl_ms", "{:>16.1f}"),
    ("pd_second_token_ms", "{:>18.1f}"),
    ("pd_itl_ms", "{:>9.1f}"),
    ("transfer_ms", "{:>11.1f}"),
    ("overlapped_ms", "{:>13.1f}"),
)


def print_table(rows: Sequence[dict[str, Any]], skipped: Sequence[str], n: int) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"medians of {n} requests, max_tokens {MAX_TOKENS}, times in ms; load average {load}")
    if any(row.get("hosts") == "netns" for row in rows):
        print("prefill, decode and router each in a network namespace of its own: KV over TCP")
    # Every column but the model's is as wide as its key.
    print(f"{'model':<14} " + " ".join(key for key, _ in COLUMNS[1:]))
    for row in rows:
        cells = []
        for key, fmt in COLUMNS:
            value = row[key]
            cells.append("-".rjust(len(key)) if value is None else fmt.format(value))
        print(" ".join(cells))
    if rows and not any(row["overlap_reported"] for row in rows):
        print("overlap: 0.0 = the router's kvtransfer object has no kv_overlapped_s")
    for line in skipped:
        print(f"skipped: {line}")
    for row in rows:
        print_breakdown(row)


def print_breakdown(row: dict[str, Any]) -> None:
    """Where each setup's first token spent its time, segment by segment (medians; they add
    up to about the TTFT), and which segments make the difference."""
    print(
        f"\n{row['model']} ({row['data_plane']}), {row['prompt_tokens']} tokens: TTFT colocated "
        f"{row['colocated_ttft_ms']:.2f} ms, P/D {row['pd_ttft_ms']:.2f} ms "
        f"(goal <= {row['ttft_goal_ms']:.2f})"
    )
    print(f"{'segment':<24} {'colocated_ms':>12} {'pd_ms':>8} {'pd_minus_colocated':>18}")
    for name, cells in row["ttft_breakdown"].items():
        c, p = cells["colocated_ms"], cells["pd_ms"]
        diff = (p or 0.0) - (c or 0.0)
        c_text = "-" if c is None else f"{c:.3f}"
        p_text = "-" if p is None else f"{p:.3f}"
        print(f"{name:<24} {c_text:>12} {p_text:>8} {diff:>18.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 requests, fewer lengths")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--n", type=int, default=None, help="requests per case (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--data-planes",
        nargs="+",
        choices=("rma", "tagged", "push"),
        default=["rma"],
        help="the P/D pair's data plane(s): one set of processes each, in one table "
        "(e.g. --data-planes rma push: push against streamed pull)",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="the prefill, the decode and the router each in its own network namespace (root): "
        "KV crosses TCP, as between hosts",
    )
    parser.add_argument(
        "--no-kv-stream",
        action="store_true",
        help="the router calls decode only once the prefill returned (no layer-wise streaming)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more router argument (repeat; e.g. --router-arg=--kv-stream "
        "--router-arg=always to compare with the default)",
    )
    args = parser.parse_args(argv)
    n = args.n or (3 if args.quick else 7)
    lengths = args.lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="kvtransfer-pd-latency-"))
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (ip netns, veth pairs)")
    namespaces = make_namespaces() if args.netns else None
    try:
        placement = namespaces.setup() if namespaces is not None else None
        for model in args.models:
            router_flags = ["--no-kv-stream"] if args.no_kv_stream else []
            router_flags += args.router_arg
            for plane in args.data_planes:
                model_rows, model_skipped = run_model(
                    model, lengths, n, rng, log_dir, router_flags, plane, placement
                )
                rows += model_rows
                skipped += [
                    f"{model} ({plane}) {length} tokens: {why}"
                    for length, why in sorted(model_skipped.items())
                ]
    except KeyboardInterrupt:
        print(f"interrupted; logs kept in {log_dir}", file=sys.stderr)
        return 130
    except (BenchError, ServiceStartError) as exc:
        print(f"failed: {exc}\nlogs kept in {log_dir}", file=sys.stderr)
        return 1
    finally:
        if namespaces is not None:
            namespaces.teardown()
    shutil.rmtree(log_dir, ignore_errors=True)
    print_table(rows, skipped, n)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        write_png("pd_latency", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
