"""Routing policies on a shared-prefix, multi-turn workload: real daemons, one router per setup.

    .venv/bin/python benchmarks/routing.py [--quick] [--model builtin:small] [--json out.json]

Every setup runs on fresh daemons (cold caches), started as real processes on this machine, one
after the other in one run, with the same workload (same seed):

- ``round_robin``, ``least_load``: 2 prefill + 2 decode daemons behind a router with
  ``--policy NAME``;
- ``cache_aware/approx``: the same with ``--policy cache_aware --tokenizer MODEL``: the router
  tokenizes the text prompts and learns what each instance holds from its own picks;
- ``cache_aware/events``: the same plus ``--kv-events-port``/``--kv-events-replay-port``: the
  router subscribes to every daemon's KV cache events (the setup waits until the router's
  index is live, ``kvtransfer_router_index_precise`` 1, for every instance);
- ``colocated``: the same cores as 2 aggregated daemons (``kvtransfer-decode`` with the no-op
  connector, each with the KV blocks of a prefill and a decode daemon together) listed with
  ``--aggregated`` (each request runs on one of them alone, which computes its prompt as a
  colocated engine does; aggregated instances in docs/router.md), ``--tokenizer MODEL`` and
  ``--policy least_load`` (``--colocated-policy``).

One host, one events port: every daemon binds its gRPC server, its ``/metrics`` and its KV
event sockets on an address of its own in 127.0.0.0/8 (prefill i on 127.0.0.(10+i), decode i on
127.0.0.(12+i); ``--address-base``), so the router's ``tcp://<instance host>:PORT`` reaches each
one. Daemons run with ``OMP_NUM_THREADS`` 1 (``--threads``): 4 engine threads on the machine's
cores for P/D, 2 for colocated.

The workload, driven by an asyncio HTTP client (aiohttp) at ``--concurrency``: ``--prefixes``
system prompts of 400-600 tokens (the built-in models' tokenizer is bytes: a character is a
token) shared by ``--sessions`` conversations of ``--turns`` turns; turn k+1's prompt is turn
k's prompt, its answer and a new user message (32-96 tokens), so a conversation's history is a
prefix too. Each worker runs one conversation's turns in order, then takes the next one.
``/v1/completions`` with a text prompt, ``stream``, ``max_tokens`` ``--max-tokens`` with
``ignore_eos``, greedy. Then a "hot prefix" phase on the same daemons: ``--hot``
single-turn requests, all on one system prompt, each with its own user message.

The KV pools are sized so that prefix caching matters: a prefill daemon's ``--prefill-blocks``
(128 blocks of 16 tokens) hold about the 4 system prompts and nothing else, so the fleet's
prefill caches hold the shared prefixes once between them, not on every instance: a policy that
keeps sending a prefix to the same prefill keeps it cached, one that spreads every prefix over
both keeps evicting it.

Per setup: TTFT p50/p99 (request sent to the first SSE chunk with text), ITL p99 (every gap
between consecutive text chunks, the first-to-second included: in P/D it holds the KV pull),
requests/s and output tokens/s (the phase's wall time), the prefix hit rate (prompt tokens
served from a prefix cache over all prompt tokens: the router's
``usage.prompt_tokens_details.cached_tokens``, the prefill daemon's hit, or the decode's when it
ran alone), tokens computed (prompt tokens - cached), tokens transferred (the decode daemons'
``kv_tokens_received`` counter from KVAdmin status, before and after) and recomputed after a
failed load (``kv_tokens_recomputed``), and each instance's share of the requests (from the
answers' ``kvtransfer`` object; the router's ``picks`` from ``GET /workers`` in the JSON). As a
cross-check of ``cached_tokens``, the blocks each daemon stored in its prefix cache during the
phase are read back from its KV event replay socket and compared with what the answers imply
(JSON: ``events_check``).

Goals (issue 23), printed met / missed: cache_aware/events has at least 2x round_robin's
prefix hit rate and at most 0.5x its TTFT p50; in the hot-prefix phase no instance of a
cache-aware setup takes more than 1.5x its fair share of the requests (per role).

A full run takes about 8 minutes on 2 cores with ``builtin:small`` (24 conversations of 4
turns, 24 hot requests); ``--quick`` (8 of 2, 8 hot, 8 tokens out) about 2. Every
process is stopped at the end, also on an error or Ctrl-C; logs are kept (and named) when
something failed or blocks were left in use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import socket
import string
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import zmq
from plots import write_png

from kvtransfer.clients.control import AdminClient
from kvtransfer.router.routing.kv_events import decode_batch
from kvtransfer.serve.kv_events import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored
from kvtransfer.serve.launcher import (
    ServiceProcess,
    ServiceStartError,
    daemon_command,
    router_command,
)

MODEL_NAME = "routing-bench"
BLOCK_SIZE = 16
NOOP_CONNECTOR = {
    "kv_connector": "KVConnectorBase_V1",
    "kv_connector_module_path": "kvtransfer.connector.base",
    "kv_role": "kv_both",
}
SETUPS = ("round_robin", "least_load", "cache_aware/approx", "cache_aware/events", "colocated")
REQUEST_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
ADMIN_TOKEN = "routing-benchmark"  # the router's admin API, on 127.0.0.1 for this run only


class BenchError(RuntimeError):
    """The setup is broken (a process, the router's answers)."""


# ------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Session:
    prefix: int  # which system prompt
    messages: tuple[str, ...]  # one user message per turn


@dataclass(frozen=True)
class Workload:
    prefixes: tuple[str, ...]
    sessions: tuple[Session, ...]
    hot: tuple[str, ...]  # the hot phase's prompts (one system prompt, own user messages)


def _words(rng: random.Random, length: int) -> str:
    """Printable ASCII words, exactly ``length`` characters (= tokens of the byte tokenizer)."""
    parts: list[str] = []
    size = 0
    while size < length:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:length]


def user_turn(message: str) -> str:
    return f"\nUser: {message}\nAssistant:"


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    prefixes = tuple(
        f"System {i}: " + _words(rng, rng.randint(400, 600)) for i in range(args.prefixes)
    )
    sessions = tuple(
        Session(
            prefix=rng.randrange(args.prefixes),
            messages=tuple(_words(rng, rng.randint(32, 96)) for _ in range(args.turns)),
        )
        for _ in range(args.sessions)
    )
    hot = tuple(prefixes[0] + user_turn(_words(rng, rng.randint(32, 96))) for _ in range(args.hot))
    return Workload(prefixes, sessions, hot)


# ------------------------------------------------------------------ client


@dataclass
class Answer:
    """One request as the client saw it (times in seconds from the phase's start)."""

    ok: bool
    error: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the router's usage has no prompt_tokens_details
    prefill: str | None = None
    decode: str | None = None
    kv_blocks_received: int = 0
    recomputed_tokens: int = 0


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> Answer:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    texts: list[str] = []
    info: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                return Answer(ok=False, error=f"HTTP {response.status}: {text}")
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Answer(ok=False, error=f"stream error: {chunk['error']}")
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        arrivals.append(time.perf_counter())
                        texts.append(choice["text"])
                info = chunk.get("kvtransfer") or info
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Answer(ok=False, error=f"{type(exc).__name__}: {exc}")
    if not arrivals or usage is None:
        return Answer(ok=False, error="the stream had no text or no usage chunk")
    info = info or {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Answer(
        ok=True,
        ttft_s=arrivals[0] - start,
        gaps_s=[b - a for a, b in itertools.pairwise(arrivals)],
        text="".join(texts),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=None if cached is None else int(cached),
        prefill=info.get("prefill"),
        decode=info.get("decode"),
        kv_blocks_received=int(info.get("kv_blocks_received") or 0),
        recomputed_tokens=int(info.get("num_recomputed_tokens") or 0),
    )


async def run_conversations(
    url: str, workload: Workload, concurrency: int, max_tokens: int
) -> tuple[list[Answer], float]:
    """Every session, ``concurrency`` at a time, each one's turns in order."""
    pending = deque(workload.sessions)
    answers: list[Answer] = []

    async def worker(http: aiohttp.ClientSession) -> None:
        while pending:
            session = pending.popleft()
            prompt = workload.prefixes[session.prefix]
            for message in session.messages:
                prompt += user_turn(message)
                answer = await complete(http, url, prompt, max_tokens)
                answers.append(answer)
                if not answer.ok:
                    break  # the conversation cannot go on without its answer
                prompt += answer.text

    return answers, await _drive(worker, concurrency)


async def run_hot(
    url: str, prompts: Sequence[str], concurrency: int, max_tokens: int
) -> tuple[list[Answer], float]:
    pending = deque(prompts)
    answers: list[Answer] = []

    async def worker(http: aiohttp.ClientSession) -> None:
        while pending:
            answers.append(await complete(http, url, pending.popleft(), max_tokens))

    return answers, await _drive(worker, concurrency)


async def _drive(worker: Any, concurrency: int) -> float:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return time.perf_counter() - start


# ------------------------------------------------------------------ processes


@dataclass
class Daemon:
    role: str  # prefill | decode (a colocated daemon is a decode daemon)
    host: str
    process: ServiceProcess

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def replay(self) -> str:
        return str(self.process.ready["kv_events_replay"])


def free_ports(hosts: Sequence[str], count: int) -> list[int]:
    """``count`` ports free on every one of ``hosts`` (checked by binding, then released)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        if port in ports:
            continue
        try:
            for host in hosts:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        ports.append(port)
    return ports


class Cluster:
    """One setup's daemons and router; `close` stops them all (router first)."""

    def __init__(self, setup: str, args: argparse.Namespace, log_dir: Path) -> None:
        self.setup = setup
        self.args = args
        self.log_dir = log_dir
        self.daemons: list[Daemon] = []
        self.router: ServiceProcess | None = None
        self.leaks: dict[str, int | None] = {}
        self.flags: list[str] = []

    @property
    def colocated(self) -> bool:
        return self.setup == "colocated"

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.address

    def start(self) -> None:
        args = self.args
        base = args.address_base
        if self.colocated:
            plan = [("decode", f"colo{i}", f"127.0.0.{base + i}") for i in range(2)]
        else:
            plan = [("prefill", f"prefill{i}", f"127.0.0.{base + i}") for i in range(2)]
            plan += [("decode", f"decode{i}", f"127.0.0.{base + 2 + i}") for i in range(2)]
        events, replay = free_ports([host for _, _, host in plan], 2)
        env = {"OMP_NUM_THREADS": str(args.threads)}

        def launch(item: tuple[str, str, str]) -> Daemon:
            role, name, host = item
            if self.colocated:
                kv, blocks = NOOP_CONNECTOR, args.prefill_blocks + args.decode_blocks
            else:
                kv = {"kv_port": 0}
                blocks = args.prefill_blocks if role == "prefill" else args.decode_blocks
            argv = daemon_command(
                role,
                *("--model", args.model, "--host", host, "--port", "0"),
                *("--metrics-port", "0", "--engine-id", name),
                *("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(blocks)),
                *("--kv-transfer-config", json.dumps(kv)),
                *("--kv-events-endpoint", f"tcp://{host}:{events}"),
                *("--kv-events-replay-endpoint", f"tcp://{host}:{replay}"),
            )
            log = self.log_dir / f"{_tag(self.setup)}-{name}.log"
            return Daemon(role, host, ServiceProcess.start(name, argv, log, env=env))

        with ThreadPoolExecutor(len(plan)) as pool:
            futures = [pool.submit(launch, item) for item in plan]
            failure: BaseException | None = None
            for future in futures:
                try:
                    self.daemons.append(future.result())
                except BaseException as exc:  # the others still get stopped by close()
                    failure = failure or exc
        if failure is not None:
            raise failure
        token_file = self.log_dir / "admin-token"
        token_file.write_text(ADMIN_TOKEN)
        flags = ["--host", "127.0.0.1", "--port", "0", "--model-name", MODEL_NAME]
        flags += ["--admin-token-file", str(token_file)]
        for daemon in self.daemons:
            # A colocated daemon is an aggregated instance: it runs whole requests itself.
            flag = "--aggregated" if self.colocated else f"--{daemon.role}"
            flags += [flag, daemon.address]
        self.flags = self.router_flags(events, replay)
        flags += self.flags
        log = self.log_dir / f"{_tag(self.setup)}-router.log"
        self.router = ServiceProcess.start("router", router_command(*flags), log)

    def router_flags(self, events: int, replay: int) -> list[str]:
        model, setup = self.args.model, self.setup
        if setup == "colocated":
            return ["--policy", self.args.colocated_policy, "--tokenizer", model]
        if setup in ("round_robin", "least_load"):
            return ["--policy", setup]
        flags = ["--policy", "cache_aware", "--tokenizer", model]
        flags += ["--kv-block-size", str(BLOCK_SIZE)]
        if setup == "cache_aware/events":
            flags += ["--kv-events-port", str(events), "--kv-events-replay-port", str(replay)]
        return flags

    def close(self) -> None:
        if self.router is not None:
            self.router.terminate(STOP_TIMEOUT_S)
        for daemon in self.daemons:
            daemon.process.terminate(STOP_TIMEOUT_S)
            self.leaks[daemon.address] = daemon.process.blocks_in_use_at_exit()


@contextlib.contextmanager
def cluster(setup: str, args: argparse.Namespace, log_dir: Path) -> Iterator[Cluster]:
    running = Cluster(setup, args, log_dir)
    try:
        running.start()
        yield running
    finally:
        running.close()


def _tag(setup: str) -> str:
    return setup.replace("/", "-")


# ------------------------------------------------------------------ observing the fleet


async def router_get(url: str, path: str) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.get(f"{url}{path}", headers=headers) as response,
    ):
        return response.status, await response.text()


async def wait_ready(running: Cluster) -> dict[str, Any]:
    """Until every instance is pickable and, with events, every cache-aware index is precise;
    returns what was seen (``events_live``: False when the index never went precise)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    want_events = running.setup == "cache_aware/events"
    seen: dict[str, Any] = {"pickable": False, "events_live": None}
    while time.monotonic() < deadline:
        status, text = await router_get(running.url, "/workers")
        workers = json.loads(text).get("workers", []) if status == 200 else []
        seen["pickable"] = len(workers) == len(running.daemons) and all(
            w.get("pickable") for w in workers
        )
        if want_events:
            _, metrics = await router_get(running.url, "/metrics")
            precise = _samples(metrics, "kvtransfer_router_index_precise")
            seen["index_precise"] = precise
            seen["events_live"] = len(precise) == len(running.daemons) and all(
                v == 1.0 for v in precise.values()
            )
        if seen["pickable"] and seen["events_live"] in (None, True):
            return seen
        await asyncio.sleep(0.25)
    if not seen["pickable"]:
        raise BenchError(f"{running.setup}: the router never had every instance pickable")
    return seen


def _samples(metrics: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one series in Prometheus text format."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) :].rpartition(" ")
            found[labels] = float(value)
    return found


async def counters(running: Cluster) -> dict[str, dict[str, int]]:
    """Each daemon's KVAdmin status counters."""

    async def one(daemon: Daemon) -> tuple[str, dict[str, int]]:
        client = AdminClient(daemon.address)
        try:
            return daemon.address, dict((await client.status()).counters)
        finally:
            await client.close()

    return dict(await asyncio.gather(*(one(d) for d in running.daemons)))


async def router_picks(running: Cluster) -> dict[str, int]:
    status, text = await router_get(running.url, "/workers")
    if status != 200:
        return {}
    return {w["address"]: int(w.get("picks", 0)) for w in json.loads(text)["workers"]}


def replay_events(endpoint: str, start_seq: int) -> tuple[int, dict[str, int]]:
    """What a daemon published from ``start_seq`` on, read back from its replay socket: the
    next sequence number and the blocks stored and removed (``first_seq``: where the replay
    began, -1 when it was empty)."""
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    totals = {"stored": 0, "removed": 0, "cleared": 0, "first_seq": -1}
    next_seq = start_seq
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            _, _, seq_bytes, payload = frames
            if seq_bytes == END_OF_REPLAY:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if totals["first_seq"] < 0:
                totals["first_seq"] = seq
            next_seq = seq + 1
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored):
                    totals["stored"] += len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    totals["removed"] += len(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    totals["cleared"] += 1
    except zmq.Again:
        totals["timeout"] = 1
    finally:
        dealer.close()
    return next_seq, totals


# ------------------------------------------------------------------ one setup


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (``q`` in [0, 100])."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def shares(answers: Sequence[Answer], running: Cluster) -> dict[str, dict[str, float]]:
    """Per role, each instance's share of the requests that completed."""
    result: dict[str, dict[str, float]] = {}
    for role in ("prefill", "decode"):
        instances = [d.address for d in running.daemons if d.role == role]
        if not instances:
            continue
        counts = Counter(getattr(a, role) for a in answers if a.ok)
        total = sum(counts[i] for i in instances)
        result[role] = {i: (counts[i] / total if total else 0.0) for i in instances}
    return result


def summarize(
    answers: Sequence[Answer],
    wall_s: float,
    running: Cluster,
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
    stored: dict[str, dict[str, int]],
) -> dict[str, Any]:
    good = [a for a in answers if a.ok]
    prompt = sum(a.prompt_tokens for a in good)
    known = [a for a in good if a.cached_tokens is not None]
    cached = sum(a.cached_tokens or 0 for a in known)
    gaps = [g for a in good for g in a.gaps_s]

    def delta(name: str, role: str) -> int:
        return sum(
            after[d.address].get(name, 0) - before[d.address].get(name, 0)
            for d in running.daemons
            if d.role == role
        )

    # Blocks each daemon that computed prompts should have stored, by the answers: its prompt
    # blocks that were not cache hits (colocated: plus the blocks its generated tokens filled).
    expected: Counter[str] = Counter()
    for a in known:
        computing = a.decode if running.colocated else a.prefill
        blocks = a.prompt_tokens // BLOCK_SIZE - (a.cached_tokens or 0) // BLOCK_SIZE
        if running.colocated:
            blocks += (a.prompt_tokens + a.completion_tokens - 1) // BLOCK_SIZE
            blocks -= a.prompt_tokens // BLOCK_SIZE
        expected[computing or "?"] += blocks
    computing_role = "decode" if running.colocated else "prefill"
    check = {
        d.address: {"stored": stored[d.address]["stored"], "expected": expected[d.address]}
        for d in running.daemons
        if d.role == computing_role
    }
    return {
        "requests": len(answers),
        "errors": len(answers) - len(good),
        "error_samples": sorted({a.error for a in answers if not a.ok})[:3],
        "wall_s": wall_s,
        "ttft_p50_ms": _ms(percentile([a.ttft_s for a in good if a.ttft_s is not None], 50)),
        "ttft_p99_ms": _ms(percentile([a.ttft_s for a in good if a.ttft_s is not None], 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "requests_per_s": len(good) / wall_s if wall_s else None,
        "output_tokens_per_s": sum(a.completion_tokens for a in good) / wall_s if wall_s else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached if known else None,
        "hit_rate": (cached / sum(a.prompt_tokens for a in known)) if known else None,
        "cached_tokens_reported": len(known) == len(good),
        "computed_tokens": (prompt - cached) if known and len(known) == len(good) else None,
        "transferred_tokens": delta("kv_tokens_received", "decode"),
        "transferred_blocks": delta("kv_blocks_received", "decode"),
        "recomputed_tokens": delta("kv_tokens_recomputed", "decode"),
        "shares": shares(answers, running),
        "events_check": check,
        "events": stored,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


async def measure(
    running: Cluster, phase: str, workload: Workload, args: argparse.Namespace, seqs: dict
) -> dict[str, Any]:
    before = await counters(running)
    picks_before = await router_picks(running)
    if phase == "main":
        answers, wall = await run_conversations(
            running.url, workload, args.concurrency, args.max_tokens
        )
    else:
        answers, wall = await run_hot(running.url, workload.hot, args.concurrency, args.max_tokens)
    after = await counters(running)
    picks_after = await router_picks(running)
    stored = {}
    for daemon in running.daemons:
        seqs[daemon.address], stored[daemon.address] = await asyncio.to_thread(
            replay_events, daemon.replay, seqs.get(daemon.address, 0)
        )
    result = summarize(answers, wall, running, before, after, stored)
    result["router_picks"] = {
        address: count - picks_before.get(address, 0) for address, count in picks_after.items()
    }
    return result


def run_setup(
    setup: str, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    print(f"{setup}: starting the daemons and the router ...", file=sys.stderr, flush=True)
    with cluster(setup, args, log_dir) as running:
        ready = asyncio.run(wait_ready(running))
        seqs: dict[str, int] = {}
        print(f"{setup}: conversations ...", file=sys.stderr, flush=True)
        main_phase = asyncio.run(measure(running, "main", workload, args, seqs))
        print(f"{setup}: hot prefix ...", file=sys.stderr, flush=True)
        hot_phase = asyncio.run(measure(running, "hot", workload, args, seqs))
        instances = {d.address: f"{d.role}@{d.host}" for d in running.daemons}
    return {
        "setup": setup,
        "router_flags": running.flags,
        "instances": instances,
        "events_live_at_start": ready.get("events_live"),
        "main": main_phase,
        "hot": hot_phase,
        "blocks_in_use_at_exit": running.leaks,
    }


# ------------------------------------------------------------------ goals and the table


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {row["setup"]: row for row in rows}
    found: list[dict[str, Any]] = []
    rr, ev = by.get("round_robin"), by.get("cache_aware/events")
    if rr and ev:
        rr_hit, ev_hit = rr["main"]["hit_rate"], ev["main"]["hit_rate"]
        met = rr_hit is not None and ev_hit is not None and ev_hit >= 2 * rr_hit
        ratio = ev_hit / rr_hit if rr_hit and ev_hit is not None else None
        found.append(
            {
                "goal": "cache_aware/events prefix hit rate >= 2x round_robin's",
                "value": _fmt(ratio, "{:.2f}x", "n/a"),
                "met": met,
            }
        )
        rr_ttft, ev_ttft = rr["main"]["ttft_p50_ms"], ev["main"]["ttft_p50_ms"]
        ratio = ev_ttft / rr_ttft if rr_ttft and ev_ttft is not None else None
        found.append(
            {
                "goal": "cache_aware/events TTFT p50 <= 0.5x round_robin's",
                "value": _fmt(ratio, "{:.2f}x", "n/a"),
                "met": ratio is not None and ratio <= 0.5,
            }
        )
    for setup in ("cache_aware/approx", "cache_aware/events"):
        row = by.get(setup)
        if row is None:
            continue
        for role, parts in row["hot"]["shares"].items():
            worst = max(parts.values(), default=0.0)
            fair = 1 / len(parts)
            found.append(
                {
                    "goal": f"{setup} hot prefix: no {role} above 1.5x its fair share",
                    "value": f"max share {worst:.0%} (limit {1.5 * fair:.0%})",
                    "met": worst <= 1.5 * fair + 1e-9,
                }
            )
    return found


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else spec.format(value)


COLUMNS = (
    ("setup", 18, lambda p: p["setup"]),
    ("TTFT p50", 8, lambda p: _fmt(p["ttft_p50_ms"], "{:.0f}")),
    ("TTFT p99", 8, lambda p: _fmt(p["ttft_p99_ms"], "{:.0f}")),
    ("ITL p99", 7, lambda p: _fmt(p["itl_p99_ms"], "{:.0f}")),
    ("req/s", 5, lambda p: _fmt(p["requests_per_s"], "{:.2f}")),
    ("tok/s", 5, lambda p: _fmt(p["output_tokens_per_s"], "{:.1f}")),
    ("hit", 4, lambda p: _fmt(p["hit_rate"], "{:.0%}")),
    ("computed", 8, lambda p: _fmt(p["computed_tokens"], "{}")),
    ("moved", 6, lambda p: str(p["transferred_tokens"])),
    ("recomp", 6, lambda p: str(p["recomputed_tokens"])),
    ("err", 3, lambda p: str(p["errors"])),
    ("prefill shares", 14, lambda p: _share_cell(p, "prefill")),
    ("decode shares", 13, lambda p: _share_cell(p, "decode")),
)


def _share_cell(phase: dict[str, Any], role: str) -> str:
    parts = phase["shares"].get(role)
    return "-" if not parts else "/".join(f"{v:.0%}" for v in parts.values())


def print_table(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    requests = args.sessions * args.turns
    print(
        f"model {args.model}; {args.prefixes} system prompts, {args.sessions} conversations x "
        f"{args.turns} turns = {requests} requests, then {args.hot} on one hot prompt; "
        f"concurrency {args.concurrency}, {args.max_tokens} tokens out; KV blocks: prefill "
        f"{args.prefill_blocks}, decode {args.decode_blocks}, colocated "
        f"{args.prefill_blocks + args.decode_blocks}; load average {load}"
    )
    print(
        "times in ms; hit: prompt tokens served from a prefix cache; computed: prompt tokens "
        "computed; moved: KV tokens decode pulled; recomp: tokens recomputed after a failed "
        "load; shares: requests per instance"
    )
    colocated = next((r for r in rows if r["setup"] == "colocated"), None)
    if colocated is not None:
        print(
            f"colocated = 2 decode daemons alone (no-op connector), router "
            f"{' '.join(colocated['router_flags'])}"
        )
    for phase, title in (("main", "shared prefixes, multi-turn"), ("hot", "one hot prefix")):
        print(f"\n{title}:")
        print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS))
        for row in rows:
            cells = [cell(row[phase] | {"setup": row["setup"]}) for _, _, cell in COLUMNS]
            print(" ".join(f"{c:>{w}}" for c, (_, w, _) in zip(cells, COLUMNS, strict=True)))
    for row in rows:
        if row["events_live_at_start"] is False:
            print(f"{row['setup']}: the router's index never went precise before the run")
        leaks = {k: v for k, v in row["blocks_in_use_at_exit"].items() if v}
        if leaks:
            print(f"{row['setup']}: KV blocks in use at exit: {leaks}")
        for phase in ("main", "hot"):
            for error in row[phase]["error_samples"]:
                print(f"{row['setup']} {phase}: error: {error}")
            if not row[phase]["cached_tokens_reported"]:
                print(f"{row['setup']} {phase}: the router's usage has no cached_tokens")
    print("\ngoals (issue 23):")
    for goal in goals(rows):
        print(f"  {'met   ' if goal['met'] else 'MISSED'}  {goal['goal']}: {goal['value']}")


# ------------------------------------------------------------------ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (about 2 minutes)")
    parser.add_argument("--model", default="builtin:small", help="the daemons' --model")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--prefixes", type=int, default=4, help="shared system prompts")
    parser.add_argument("--sessions", type=int, default=None, help="conversations (24)")
    parser.add_argument("--turns", type=int, default=None, help="turns per conversation (4)")
    parser.add_argument("--hot", type=int, default=None, help="hot-prefix requests (24)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens out (16)")
    parser.add_argument("--prefill-blocks", type=int, default=128)
    parser.add_argument("--decode-blocks", type=int, default=384)
    parser.add_argument("--colocated-policy", default="least_load")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per daemon")
    parser.add_argument("--address-base", type=int, default=10, help="daemons on 127.0.0.N+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    quick = args.quick
    args.sessions = args.sessions or (8 if quick else 24)
    args.turns = args.turns or (2 if quick else 4)
    args.hot = args.hot or (8 if quick else 24)
    args.max_tokens = args.max_tokens or (8 if quick else 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    workload = make_workload(args)
    log_dir = Path(tempfile.mkdtemp(prefix="kvtransfer-routing-"))
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for setup in args.setups:
            rows.append(run_setup(setup, workload, args, log_dir))
    except KeyboardInterrupt:
        print(f"interrupted; logs kept in {log_dir}", file=sys.stderr)
        return 130
    except (BenchError, ServiceStartError) as exc:
        print(f"failed: {exc}\nlogs kept in {log_dir}", file=sys.stderr)
        return 1
    print_table(rows, args)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    bad = any(row[phase]["errors"] for row in rows for phase in ("main", "hot")) or any(
        any(v for v in row["blocks_in_use_at_exit"].values()) for row in rows
    )
    if bad:
        print(f"logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    if args.json is not None:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "setups": rows}
        report["goals"] = goals(rows)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        write_png("routing", args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
