"""Chaos: real daemons and router under load while peers are killed, stopped and partitioned.

A prefill daemon, a decode daemon and the router run as processes (on 127.0.0.1, or with
``--netns`` each in its own network namespace behind a veth pair and a bridge). A bounded load
of fresh prompts (greedy ``/v1/completions``, some streamed, some abandoned mid-request by the
client) runs while a schedule injects, one after the other with load in between:

1. ``kill -9`` of the prefill daemon; a decode request whose KV lives on the dead prefill is
   timed until it fails (and so is the router's answer while prefill is dead); restart on the
   same ports; time until a request succeeds through the router again;
2. ``kill -9`` of the decode daemon; the prefill's blocks in use are sampled every 100 ms while
   decode is dead; restart on the same port; time until a request succeeds again;
3. SIGSTOP of the prefill daemon for a few seconds (shorter than the KV lease), then SIGCONT;
4. with ``--netns``: a partition (the prefill's veth on the bridge set down) and a heal; a
   decode request whose producer is behind the partition is timed until it fails.

Every completed request's token ids (the router's ``kvtransfer`` object) are compared with a
colocated run of the same model in this process. Once the load has drained, no daemon may
hold a KV block 2 s later (nothing held for the dead, not even until its lease runs out); the
blocks are polled until the lease would have freed them too. Prints a table (goals from issue
10 beside the figures) and writes JSON. Recovery is timed from the restarted daemon's process
start (the issue's definition, so engine start-up counts) and from its readiness.

    python benchmarks/chaos.py [--concurrency 6] [--gap-s 8] [--netns] [--json results.json]

Exits 1 when an invariant broke (wrong tokens, hung requests, blocks left in use), 2 when the
daemons could not be started; timing goals missed are reported, not fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvtransfer.clients.control import AdminClient, RetryPolicy
from kvtransfer.clients.generation import GenerationClient, generate_request
from kvtransfer.serve.launcher import (
    ServiceProcess,
    ServiceStartError,
    daemon_command,
    router_command,
)

GOAL_RECOVERY_S = 2.0
GOAL_DEAD_PRODUCER_S = 2.0
SAMPLE_INTERVAL_S = 0.1
PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 10.0
RECOVERY_GIVE_UP_S = 60.0
REFERENCE_BATCH = 8
DRAIN_GRACE_S = 2.0
# The daemons' and the colocated engine's default (tokens per KV block).
BLOCK_SIZE = 16

_VOCABULARY = (
    "prefill decode cache block lease router token stream layer head slice pull release engine "
    "worker socket bridge partition restart signal stop resume quick brown fox lazy dog river "
    "stone cloud paper window garden silver orange copper violet"
)
_WORDS = tuple(_VOCABULARY.split())

# Network namespaces (--netns): a switch namespace with a bridge, one namespace per service,
# and a veth from this (the load's) namespace to the bridge. Names and the subnet are this
# benchmark's own, so other namespaces on the machine are left alone.
NS_PREFIX = "kvchaos"
NS_SUBNET = "10.239.0"
NS_ADDRESSES = {"host": 1, "prefill": 2, "decode": 3, "router": 4}
NS_PORTS = {"prefill": 50051, "prefill_kv": 50052, "decode": 50061, "router": 8000}


class ChaosAbort(RuntimeError):
    """The run cannot go on (nothing works before any fault); the message says why."""


# ------------------------------------------------------------------ where things run


@dataclass
class Placement:
    """Addresses and ports of the services, and the command prefix that puts each where it
    runs (nothing on 127.0.0.1, ``ip netns exec NS`` with namespaces)."""

    hosts: dict[str, str]
    ports: dict[str, int]
    wrap: dict[str, list[str]] = field(default_factory=dict)
    namespaces: bool = False

    def address(self, role: str) -> str:
        return f"{self.hosts[role]}:{self.ports[role]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_placement() -> Placement:
    ports = {role: _free_port() for role in ("prefill", "prefill_kv", "decode", "router")}
    hosts = dict.fromkeys(("prefill", "decode", "router"), "127.0.0.1")
    return Placement(hosts, ports)


class Namespaces:
    """Minimal veth set-up: ``<prefix>-sw`` holds bridge ``br0``; each service namespace's
    ``eth0`` is paired with ``<role>`` on the bridge; ``<prefix>-h`` links this namespace."""

    def __init__(self, prefix: str = NS_PREFIX) -> None:
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.ns = {role: f"{prefix}-{role[0]}" for role in ("prefill", "decode", "router")}
        self.host_link = f"{prefix}-h"

    def bridge_port(self, role: str) -> str:
        """The bridge side of ``role``'s veth: setting it down partitions ``role``."""
        return f"sw-{role[0]}"

    def setup(self) -> Placement:
        self.teardown()
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        hosts = {}
        for role, ns in self.ns.items():
            address = f"{NS_SUBNET}.{NS_ADDRESSES[role]}"
            port = self.bridge_port(role)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            hosts[role] = address
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "sw-h", "netns", sw)
        _ip("-n", sw, "link", "set", "sw-h", "master", "br0", "up")
        _ip("addr", "add", f"{NS_SUBNET}.{NS_ADDRESSES['host']}/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        wrap = {role: ["ip", "netns", "exec", ns] for role, ns in self.ns.items()}
        return Placement(hosts, dict(NS_PORTS), wrap, namespaces=True)

    def partition(self, role: str) -> None:
        _ip("-n", self.switch, "link", "set", self.bridge_port(role), "down")

    def heal(self, role: str) -> None:
        _ip("-n", self.switch, "link", "set", self.bridge_port(role), "up")

    def teardown(self) -> None:
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in existing.splitlines() if line.strip()}
        for ns in (*self.ns.values(), self.switch):
            if ns in names:
                _ip("netns", "del", ns)
        # The host end goes with its peer in the switch namespace; this covers a half set-up.
        if Path(f"/sys/class/net/{self.host_link}").exists():
            _ip("link", "del", self.host_link)


class HelperNamespaces(Namespaces):
    """The test tier's hosts (``tests/netns_helpers.topology.Network``: a switch namespace,
    one namespace per service with an unrouted second interface), plus this namespace's own
    veth to the switch (``.1``) for the load, the admin calls and the direct gRPC calls."""

    def __init__(self, network_cls: Any) -> None:
        super().__init__()
        self._network_cls = network_cls
        self.network: Any = None
        self.hosts: dict[str, Any] = {}

    def bridge_port(self, role: str) -> str:
        return str(self.hosts[role].port)

    def setup(self) -> Placement:
        self.teardown()
        self.network = network = self._network_cls("chaos")
        for role in ("prefill", "decode", "router"):
            self.hosts[role] = network.add_host(role)
        self.switch = network.switch
        subnet = self.hosts["prefill"].address.rsplit(".", 1)[0]
        _ip(
            "link",
            "add",
            self.host_link,
            "type",
            "veth",
            "peer",
            "name",
            "sw-h",
            "netns",
            network.switch,
        )
        _ip("-n", network.switch, "link", "set", "sw-h", "master", "br0", "up")
        _ip("addr", "add", f"{subnet}.1/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        hosts = {role: host.address for role, host in self.hosts.items()}
        wrap = {role: host.command([]) for role, host in self.hosts.items()}
        return Placement(hosts, dict(NS_PORTS), wrap, namespaces=True)

    def teardown(self) -> None:
        if self.network is not None:
            self.network.close()  # the host link goes with its peer in the switch
            self.network = None
        if Path(f"/sys/class/net/{self.host_link}").exists():
            _ip("link", "del", self.host_link)


def make_namespaces() -> Namespaces:
    """The test tier's namespace helpers when this checkout has them, else the set-up above."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if (tests / "netns_helpers" / "topology.py").exists():
        sys.path.insert(0, str(tests))
        try:
            from netns_helpers.topology import Network  # type: ignore[import-not-found]
        except ImportError:
            pass
        else:
            return HelperNamespaces(Network)
        finally:
            sys.path.remove(str(tests))
    return Namespaces()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


# ------------------------------------------------------------------ the services


class Services:
    """The prefill and decode daemons and the router, each restartable on the same ports."""

    def __init__(self, args: argparse.Namespace, placement: Placement, log_dir: Path) -> None:
        self.args = args
        self.placement = placement
        self.log_dir = log_dir
        self.procs: dict[str, ServiceProcess] = {}
        self.retired: list[ServiceProcess] = []
        self.starts: Counter[str] = Counter()

    def start(self, role: str) -> tuple[float, float]:
        """Start ``role``; returns (spawned, ready) on the monotonic clock."""
        self.starts[role] += 1
        name = f"{role}-{self.starts[role]}"
        argv = self.placement.wrap.get(role, []) + self._command(role)
        spawned = time.monotonic()
        proc = ServiceProcess.start(name, argv, self.log_dir / f"{name}.log")
        ready = time.monotonic()
        self.procs[role] = proc
        return spawned, ready

    def _command(self, role: str) -> list[str]:
        p, args = self.placement, self.args
        if role == "router":
            return router_command(
                "--host",
                p.hosts["router"],
                "--port",
                str(p.ports["router"]),
                "--prefill",
                p.address("prefill"),
                "--decode",
                p.address("decode"),
                "--request-timeout-s",
                str(args.router_deadline_s),
            )
        host = p.hosts[role]
        kv: dict[str, Any] = {
            "kv_ip": host,
            "kv_port": p.ports["prefill_kv"] if role == "prefill" else 0,
            "kv_connector_extra_config": {
                "kv_lease_s": args.kv_lease_s,
                "data_plane": args.data_plane,
            },
        }
        return daemon_command(
            role,
            "--model",
            args.model,
            "--host",
            host,
            "--port",
            str(p.ports[role]),
            "--engine-id",
            f"chaos-{role}",
            "--kv-transfer-config",
            json.dumps(kv),
        )

    def pid(self, role: str) -> int:
        return self.procs[role].pid

    def kill(self, role: str) -> None:
        proc = self.procs.pop(role)
        proc.kill()
        self.retired.append(proc)

    def stop_all(self) -> dict[str, dict[str, Any]]:
        """SIGTERM (router first); each daemon's exit code and its KV blocks in use at exit."""
        stopped: dict[str, dict[str, Any]] = {}

        def stop(role: str) -> None:
            proc = self.procs.pop(role)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # never leave a stopped process behind
            code = proc.terminate(timeout_s=30.0)
            at_exit = proc.blocks_in_use_at_exit() if role != "router" else None
            stopped[role] = {"exit_code": code, "blocks_in_use_at_exit": at_exit}

        if "router" in self.procs:
            stop("router")
        # Then both daemons at once: each drains on its own.
        threads = [threading.Thread(target=stop, args=(role,)) for role in list(self.procs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for proc in self.retired:
            proc.kill()
        return stopped


# ------------------------------------------------------------------ requests


@dataclass
class Outcome:
    """One request through the router, as the client saw it."""

    index: int
    kind: str  # load | probe
    prompt: str
    max_tokens: int
    stream: bool
    phase: str
    started_s: float
    elapsed_s: float = 0.0
    # ok | typed (HTTP error or SSE error event with an OpenAI error body) | untyped | hung
    # | aborted (the client disconnected on purpose)
    status: str = ""
    http_status: int | None = None
    error: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    request_id: str = ""
    # Filled in after the colocated run: True, False (wrong) or None (nothing to check).
    correct: bool | None = None


@dataclass
class Spec:
    prompt: str
    max_tokens: int
    stream: bool
    abort_after_s: float | None


class Load:
    """The load generator, the schedule's phase labels and every outcome."""

    def __init__(self, args: argparse.Namespace, base_url: str, rng: random.Random) -> None:
        self.args = args
        self.base_url = base_url
        self.rng = rng
        self.t0 = time.monotonic()
        self.phase = "steady"
        self.outcomes: list[Outcome] = []
        self.inflight: dict[int, Spec] = {}
        self.stop = asyncio.Event()
        self.started = asyncio.Event()
        self._next = 0
        self.hung_after_s = args.router_deadline_s + args.hang_margin_s
        self.session: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fresh_prompt(self, index: int) -> str:
        words = self.rng.choices(_WORDS, k=self.rng.randint(3, 60))
        return f"chaos request {index} {self.rng.getrandbits(32):08x}: " + " ".join(words)

    def next_spec(self, index: int) -> Spec:
        rng, args = self.rng, self.args
        abort = rng.random() < args.abort_fraction
        return Spec(
            prompt=self.fresh_prompt(index),
            max_tokens=rng.choice((4, 8, 16, 24, 32)),
            stream=rng.random() < args.stream_fraction,
            abort_after_s=rng.uniform(0.01, 0.3) if abort else None,
        )

    async def run(self, load: Awaitable[None]) -> None:
        """Runs ``load`` (a coroutine that returns once the load should end) beside the
        workers; the client sessions live as long as this."""
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))
            for _ in range(2)
        ]
        self.session, self.probe_session = sessions
        try:
            workers = [self._worker() for _ in range(self.args.concurrency)]
            await asyncio.gather(self._until_stopped(load), *workers)
        finally:
            for session in sessions:
                await session.close()

    async def _until_stopped(self, load: Awaitable[None]) -> None:
        try:
            await load
        finally:
            self.stop.set()

    async def _worker(self) -> None:
        await self.started.wait()
        while not self.stop.is_set() and self._next < self.args.max_requests:
            index = self._next
            self._next += 1
            spec = self.next_spec(index)
            self.inflight[index] = spec
            try:
                outcome = await self.request(index, "load", spec)
            finally:
                del self.inflight[index]
            if outcome.status not in ("ok", "aborted"):
                # A client that got an error pauses before its next request, as real ones do.
                await asyncio.sleep(self.args.fail_pause_s)

    async def request(
        self, index: int, kind: str, spec: Spec, limit_s: float | None = None
    ) -> Outcome:
        outcome = Outcome(
            index, kind, spec.prompt, spec.max_tokens, spec.stream, self.phase, self.now()
        )
        self.outcomes.append(outcome)
        body = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": 0,
            "stream": spec.stream,
        }
        limit = self.hung_after_s if limit_s is None else limit_s
        aborting = spec.abort_after_s is not None and spec.abort_after_s < limit
        if aborting:
            limit = spec.abort_after_s  # type: ignore[assignment]
        started = time.monotonic()
        try:
            session = self.probe_session if kind == "probe" else self.session
            assert session is not None
            await asyncio.wait_for(self._exchange(session, body, outcome), timeout=limit)
        except TimeoutError:
            outcome.status = "aborted" if aborting else "hung"
            outcome.error = f"no answer within {limit:.2f} s"
        except (aiohttp.ClientError, ConnectionError) as exc:
            outcome.status = "untyped"
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.elapsed_s = time.monotonic() - started
        return outcome

    async def _exchange(
        self, session: aiohttp.ClientSession, body: dict[str, Any], outcome: Outcome
    ) -> None:
        url = f"{self.base_url}/v1/completions"
        async with session.post(url, json=body) as response:
            outcome.http_status = response.status
            outcome.request_id = response.headers.get("x-request-id", "")
            if response.status != 200 or not body["stream"]:
                text = await response.text()
                _classify_json(outcome, response.status, text)
                return
            done = False
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    outcome.status, outcome.error = "untyped", f"bad SSE data: {data[:200]}"
                    return
                if "error" in chunk:
                    typed = _is_openai_error(chunk)
                    outcome.status = "typed" if typed else "untyped"
                    outcome.error = "SSE error event: " + json.dumps(chunk["error"])[:300]
                    return
                info = chunk.get("kvtransfer")
                if info is not None:
                    outcome.token_ids = list(info["token_ids"])
                    outcome.finish_reason = _finish_reason(chunk)
            if not done or outcome.token_ids is None:
                outcome.status = "untyped"
                outcome.error = "the stream ended without [DONE] and a kvtransfer object"
            else:
                outcome.status = "ok"


def _finish_reason(body: dict[str, Any]) -> str | None:
    try:
        return body["choices"][0]["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return None


def _is_openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


def _classify_json(outcome: Outcome, status: int, text: str) -> None:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        outcome.status, outcome.error = "untyped", f"HTTP {status}, not JSON: {text[:200]}"
        return
    if status == 200:
        info = body.get("kvtransfer") if isinstance(body, dict) else None
        if info is None or "token_ids" not in info:
            outcome.status, outcome.error = "untyped", "HTTP 200 without kvtransfer.token_ids"
            return
        outcome.status, outcome.token_ids = "ok", list(info["token_ids"])
        outcome.finish_reason = _finish_reason(body)
        return
    if status >= 400 and _is_openai_error(body):
        outcome.status = "typed"
        outcome.error = f"HTTP {status}: {body['error']['message'][:300]}"
    else:
        outcome.status, outcome.error = "untyped", f"HTTP {status}: {text[:300]}"


# ------------------------------------------------------------------ admin and direct calls


async def blocks_in_use(address: str, timeout_s: float = 1.0) -> int | None:
    """A daemon's KV blocks in use (KVAdmin.GetStatus); ``None`` when it does not answer."""
    client = AdminClient(address, timeout_s=timeout_s, retry=RetryPolicy(max_attempts=1))
    try:
        return (await client.status()).num_used_blocks
    except Exception:
        return None
    finally:
        await client.close()


async def held_transfers(address: str) -> list[dict[str, Any]] | None:
    """KVAdmin.ListTransfers: the KV a daemon holds for consumers or is loading."""
    client = AdminClient(address, timeout_s=2.0, retry=RetryPolicy(max_attempts=1))
    try:
        transfers = await client.transfers()
    except Exception:
        return None
    finally:
        await client.close()
    return [
        {
            "request_id": t.request_id,
            "direction": t.direction.name,
            "num_blocks": t.num_blocks,
            "age_s": round(t.age_s, 2),
        }
        for t in transfers
    ]


async def daemon_status(address: str) -> dict[str, Any] | None:
    client = AdminClient(address, timeout_s=2.0, retry=RetryPolicy(max_attempts=1))
    try:
        status = await client.status()
    except Exception:
        return None
    finally:
        await client.close()
    return {
        "num_used_blocks": status.num_used_blocks,
        "num_free_blocks": status.num_free_blocks,
        "counters": dict(status.counters),
    }


def direct_prefill(address: str, request_id: str, prompt: str) -> dict[str, Any]:
    """Prefill ``prompt`` on the daemon for a remote decode; returns its kv_transfer_params."""
    with GenerationClient(address) as client:
        message = generate_request(
            request_id, prompt, 1, temperature=0.0, kv_transfer_params={"do_remote_decode": True}
        )
        result = client.generate(message, timeout_s=30.0)
    if not result.kv_transfer_params:
        raise RuntimeError(f"prefill {address} returned no kv_transfer_params: {result}")
    return result.kv_transfer_params


def direct_decode_failure(
    address: str, request_id: str, prompt: str, params: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Decode with params whose producer is gone; how long until it fails, and how."""
    started = time.monotonic()
    with GenerationClient(address) as client:
        message = generate_request(
            request_id, prompt, 8, temperature=0.0, kv_transfer_params=params
        )
        try:
            result = client.generate(message, timeout_s=timeout_s)
        except grpc.RpcError as exc:  # the typed failure expected
            outcome = f"gRPC {exc.code().name}: {exc.details()}"
            failed = True
        else:
            failed = result.finish_reason == "error"
            outcome = f"finish_reason={result.finish_reason!r} error={result.error!r}"
            if not failed:
                outcome += f" tokens={result.token_ids} (SUCCEEDED from a gone producer)"
    return {"seconds": time.monotonic() - started, "failed": failed, "outcome": outcome[:400]}


def release_direct(address: str, request_id: str, params: dict[str, Any]) -> str:
    try:
        with GenerationClient(address) as client:
            return "released" if client.release_kv(request_id, params) else "not held"
    except Exception as exc:
        return f"failed: {exc}"


# ------------------------------------------------------------------ the schedule


class Chaos:
    def __init__(
        self,
        args: argparse.Namespace,
        services: Services,
        load: Load,
        namespaces: Namespaces | None,
    ) -> None:
        self.args = args
        self.services = services
        self.load = load
        self.namespaces = namespaces
        self.events: list[dict[str, Any]] = []
        self.report: dict[str, Any] = {}
        self._probes = 0

    def log(self, what: str) -> None:
        print(f"[{self.load.now():6.1f}s] {what}", flush=True)
        self.events.append({"t_s": round(self.load.now(), 3), "event": what})

    async def run(self) -> None:
        args = self.args
        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("prefill kill -9 and restart", self.prefill_restart),
            ("decode kill -9 and restart", self.decode_restart),
            (f"prefill SIGSTOP for {args.stop_s:g} s", self.prefill_sigstop),
        ]
        if self.namespaces is not None:
            steps.append(("partition and heal", self.partition))
        for title, step in steps:
            await asyncio.sleep(args.gap_s)
            self.log(f"== {title}")
            await step()
            self.load.phase = "steady"
        await asyncio.sleep(args.gap_s)

    # -- helpers

    def _address(self, role: str) -> str:
        return self.services.placement.address(role)

    async def probe_until_ok(self, since: float) -> dict[str, Any]:
        """Small fresh requests through the router every 100 ms until one succeeds; seconds
        from ``since`` (monotonic) to its answer."""
        tries = 0
        while time.monotonic() - since < RECOVERY_GIVE_UP_S:
            tries += 1
            outcome = await self.probe()
            if outcome.status == "ok":
                return {
                    "seconds": time.monotonic() - since,
                    "probes": tries,
                    "last_probe_s": outcome.elapsed_s,
                }
            await asyncio.sleep(PROBE_INTERVAL_S)
        return {"seconds": None, "probes": tries, "last_probe_s": None}

    async def probe(self) -> Outcome:
        self._probes += 1
        index = 1_000_000 + self._probes
        spec = Spec(self.load.fresh_prompt(index), 4, False, None)
        return await self.load.request(index, "probe", spec, PROBE_TIMEOUT_S)

    async def sample_blocks(
        self, address: str, stop: asyncio.Event, into: list[tuple[float, int | None]]
    ) -> None:
        while not stop.is_set():
            started = time.monotonic()
            used = await blocks_in_use(address, timeout_s=0.5)
            into.append((started, used))
            await asyncio.sleep(max(0.0, SAMPLE_INTERVAL_S - (time.monotonic() - started)))

    async def restart(self, role: str) -> dict[str, Any]:
        try:
            spawned, ready = await asyncio.to_thread(self.services.start, role)
        except ServiceStartError as exc:
            self.log(f"{role} did not restart: {exc}")
            return {"start_up_s": None, "recovery_s": None, "error": str(exc)[:500]}
        self.log(
            f"{role} ready again after {ready - spawned:.2f} s (pid {self.services.pid(role)})"
        )
        recovered = await self.probe_until_ok(spawned)
        seconds = recovered["seconds"]
        after_ready = None if seconds is None else seconds - (ready - spawned)
        self.log(
            f"first success through the router {seconds if seconds is None else f'{seconds:.2f}'}"
            f" s after {role}'s process start"
        )
        return {
            "start_up_s": ready - spawned,
            "recovery_s": seconds,
            "recovery_after_ready_s": after_ready,
            "probes": recovered["probes"],
            "last_probe_s": recovered["last_probe_s"],
        }

    # -- the steps

    async def prefill_restart(self) -> None:
        tag = f"chaos-dead-producer-{os.getpid()}"
        prompt = self.load.fresh_prompt(2_000_000)
        params = await asyncio.to_thread(direct_prefill, self._address("prefill"), tag, prompt)
        self.load.phase = "prefill dead"
        self.services.kill("prefill")
        killed = time.monotonic()
        self.log("prefill killed (SIGKILL)")
        direct, routed = await asyncio.gather(
            asyncio.to_thread(
                direct_decode_failure,
                self._address("decode"),
                tag,
                prompt,
                params,
                self.args.router_deadline_s,
            ),
            self.probe(),
        )
        self.log(
            f"decode request to the dead producer: {direct['outcome'][:120]} after "
            f"{direct['seconds']:.2f} s; router answered {routed.status} "
            f"({routed.http_status}) in {routed.elapsed_s:.2f} s"
        )
        self.load.phase = "prefill restarting"
        restart = await self.restart("prefill")
        self.report["prefill_restart"] = {
            **restart,
            "dead_producer_direct": direct,
            "router_while_prefill_dead": {
                "seconds": routed.elapsed_s,
                "status": routed.status,
                "http_status": routed.http_status,
                "error": routed.error,
            },
            "killed_at_s": killed - self.load.t0,
        }

    async def decode_restart(self) -> None:
        prefill = self._address("prefill")
        before = await blocks_in_use(prefill)
        inflight = [spec.prompt for spec in self.load.inflight.values()]
        samples: list[tuple[float, int | None]] = []
        stop_sampling = asyncio.Event()
        self.load.phase = "decode dead"
        self.services.kill("decode")
        killed = time.monotonic()
        sampler = asyncio.create_task(self.sample_blocks(prefill, stop_sampling, samples))
        self.log(f"decode killed (SIGKILL); {len(inflight)} requests in flight")
        await asyncio.sleep(self.args.dead_s)
        self.load.phase = "decode restarting"
        restart = await self.restart("decode")
        stop_sampling.set()
        await sampler
        ready = killed + self.args.dead_s + (restart["start_up_s"] or 0.0)
        dead = [used for t, used in samples if t <= ready and used is not None]
        self.report["decode_restart"] = {
            **restart,
            "killed_at_s": killed - self.load.t0,
            "prefill_blocks_before_kill": before,
            "inflight_prompts_at_kill": inflight,
            "peak_prefill_blocks_while_dead": max(dead) if dead else None,
            "samples": [{"t_s": round(t - killed, 3), "used": used} for t, used in samples],
        }
        self.log(
            f"prefill blocks while decode was dead: peak {max(dead) if dead else None} over "
            f"{len(dead)} samples (before the kill: {before})"
        )

    async def prefill_sigstop(self) -> None:
        pid = self.services.pid("prefill")
        self.load.phase = "prefill stopped"
        os.kill(pid, signal.SIGSTOP)
        self.log(f"prefill stopped (SIGSTOP pid {pid})")
        await asyncio.sleep(self.args.stop_s)
        os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        self.load.phase = "prefill resumed"
        self.log("prefill resumed (SIGCONT)")
        recovered = await self.probe_until_ok(resumed)
        self.report["prefill_sigstop"] = {"stop_s": self.args.stop_s, "recovery": recovered}
        self.log(f"first success {recovered['seconds']} s after SIGCONT")

    async def partition(self) -> None:
        assert self.namespaces is not None
        tag = f"chaos-partitioned-producer-{os.getpid()}"
        prompt = self.load.fresh_prompt(3_000_000)
        prefill = self._address("prefill")
        params = await asyncio.to_thread(direct_prefill, prefill, tag, prompt)
        self.load.phase = "partitioned"
        await asyncio.to_thread(self.namespaces.partition, "prefill")
        cut = time.monotonic()
        self.log(f"prefill partitioned (ip link set {self.namespaces.bridge_port('prefill')} down)")
        direct = await asyncio.to_thread(
            direct_decode_failure,
            self._address("decode"),
            tag,
            prompt,
            params,
            self.args.router_deadline_s,
        )
        self.log(
            f"decode request to the partitioned producer: {direct['outcome'][:120]} after "
            f"{direct['seconds']:.2f} s"
        )
        await asyncio.sleep(max(0.0, self.args.partition_s - (time.monotonic() - cut)))
        await asyncio.to_thread(self.namespaces.heal, "prefill")
        healed = time.monotonic()
        self.load.phase = "healed"
        self.log("partition healed (link up)")
        recovered = await self.probe_until_ok(healed)
        # The test's own prefill: nobody pulled it; give it back as the router would.
        released = await asyncio.to_thread(release_direct, prefill, tag, params)
        self.report["partition"] = {
            "partition_s": self.args.partition_s,
            "unreachable_producer_direct": direct,
            "recovery": recovered,
            "test_kv_release": released,
        }
        self.log(f"first success {recovered['seconds']} s after the heal; test KV {released}")


# ------------------------------------------------------------------ reference and report


def colocated_reference(model: str, keys: list[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    """(prompt, max_tokens) -> the output of one colocated engine in this process (greedy)."""
    import torch

    from kvtransfer.engine.config import EngineConfig
    from kvtransfer.engine.llm import LLM
    from kvtransfer.engine.sampling_params import SamplingParams

    # One intra-op thread and small batches: on a small, busy machine torch's default threads
    # make this an order of magnitude slower. Greedy tokens are the same either way.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    outputs: list[Any] = []
    try:
        with LLM(EngineConfig(model=model)) as llm:
            for start in range(0, len(keys), REFERENCE_BATCH):
                batch = keys[start : start + REFERENCE_BATCH]
                outputs += llm.generate(
                    [prompt for prompt, _ in batch],
                    [SamplingParams(max_tokens=m) for _, m in batch],
                )
    finally:
        torch.set_num_threads(threads)
    return dict(zip(keys, outputs, strict=True))


def reference_keys(outcomes: list[Outcome], chaos: Chaos) -> list[tuple[str, int]]:
    """What needs the colocated run: completed requests (to check their tokens) and the
    prompts in flight when decode died (their block counts bound the prefill's peak)."""
    keys = {(o.prompt, o.max_tokens) for o in outcomes if o.status == "ok"}
    for prompt in chaos.report.get("decode_restart", {}).get("inflight_prompts_at_kill", []):
        keys.add((prompt, 1))
    return sorted(keys)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def _pair(first: float | None, second: float | None) -> str:
    return f"{_fmt(first, ' s')} / {_fmt(second, ' s')}"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def summarize(
    args: argparse.Namespace,
    load: Load,
    chaos: Chaos,
    reference: dict[tuple[str, int], Any],
    leaks: dict[str, Any],
    daemons: dict[str, Any],
    block_size: int,
) -> dict[str, Any]:
    wrong: list[dict[str, Any]] = []
    truncated: list[dict[str, Any]] = []
    for outcome in load.outcomes:
        if outcome.status != "ok" or outcome.token_ids is None:
            continue
        expected = reference[(outcome.prompt, outcome.max_tokens)].token_ids
        outcome.correct = outcome.token_ids == expected
        if outcome.correct:
            continue
        example = {
            "index": outcome.index,
            "request_id": outcome.request_id,
            "phase": outcome.phase,
            "stream": outcome.stream,
            "finish_reason": outcome.finish_reason,
            "got": outcome.token_ids,
            "expected": expected,
        }
        # A 200 that says it was cut short (finish_reason "abort") is not wrong if what it
        # holds is a prefix of the right answer; counted apart.
        cut = outcome.finish_reason not in ("length", "stop")
        if cut and expected[: len(outcome.token_ids)] == outcome.token_ids:
            outcome.correct = None
            truncated.append(example)
        else:
            wrong.append(example)
    statuses = Counter(o.status for o in load.outcomes)
    by_phase: dict[str, Counter[str]] = {}
    for outcome in load.outcomes:
        by_phase.setdefault(outcome.phase, Counter())[outcome.status] += 1

    decode = chaos.report.get("decode_restart", {})
    inflight_blocks = None
    if "inflight_prompts_at_kill" in decode:
        inflight_blocks = sum(
            _blocks_for(reference, prompt, block_size)
            for prompt in decode["inflight_prompts_at_kill"]
        )
    peak = decode.get("peak_prefill_blocks_while_dead")
    prefill = chaos.report.get("prefill_restart", {})
    dead_direct = prefill.get("dead_producer_direct", {})
    partition = chaos.report.get("partition")

    def recovery_goal(value: float | None) -> bool | None:
        return None if value is None else value <= GOAL_RECOVERY_S

    summary = {
        "requests": len(load.outcomes),
        "load_requests": sum(o.kind == "load" for o in load.outcomes),
        "probe_requests": sum(o.kind == "probe" for o in load.outcomes),
        "streamed": sum(o.stream for o in load.outcomes),
        "correct": sum(o.correct is True for o in load.outcomes),
        "typed_failures": statuses["typed"],
        "untyped_failures": statuses["untyped"],
        "wrong": len(wrong),
        "truncated_200s": len(truncated),
        "hung": statuses["hung"],
        "client_aborts": statuses["aborted"],
        "leaked_blocks": leaks["leaked"],
        "leaked_by_daemon": leaks["after_grace"],
        "held_for_good": leaks["held_for_good"],
        "seconds_until_final_blocks": leaks["seconds_to_final"],
        "prefill_leases_expired": ((daemons.get("prefill") or {}).get("counters") or {}).get(
            "kv_leases_expired"
        ),
        "prefill_blocks_before_decode_kill": decode.get("prefill_blocks_before_kill"),
        "prefill_recovery_s": prefill.get("recovery_s"),
        "prefill_recovery_after_ready_s": prefill.get("recovery_after_ready_s"),
        "prefill_start_up_s": prefill.get("start_up_s"),
        "decode_recovery_s": decode.get("recovery_s"),
        "decode_recovery_after_ready_s": decode.get("recovery_after_ready_s"),
        "decode_start_up_s": decode.get("start_up_s"),
        "sigstop_recovery_s": chaos.report.get("prefill_sigstop", {})
        .get("recovery", {})
        .get("seconds"),
        "heal_recovery_s": partition["recovery"]["seconds"] if partition else None,
        "peak_prefill_blocks_after_decode_death": peak,
        "inflight_blocks_at_decode_death": inflight_blocks,
        "dead_producer_fail_s": dead_direct.get("seconds"),
        "dead_producer_failed": dead_direct.get("failed"),
        "router_answer_while_prefill_dead_s": prefill.get("router_while_prefill_dead", {}).get(
            "seconds"
        ),
        "unreachable_producer_fail_s": (
            partition["unreachable_producer_direct"]["seconds"] if partition else None
        ),
    }
    goals = {
        "wrong == 0": summary["wrong"] == 0,
        "hung == 0": summary["hung"] == 0,
        "leaked == 0": summary["leaked_blocks"] == 0,
        "held for good == 0": summary["held_for_good"] == 0,
        "prefill recovery <= 2 s (from process start)": recovery_goal(
            summary["prefill_recovery_s"]
        ),
        "prefill recovery <= 2 s (from ready)": recovery_goal(
            summary["prefill_recovery_after_ready_s"]
        ),
        "decode recovery <= 2 s (from process start)": recovery_goal(summary["decode_recovery_s"]),
        "decode recovery <= 2 s (from ready)": recovery_goal(
            summary["decode_recovery_after_ready_s"]
        ),
        "dead producer fails <= 2 s": (
            None
            if summary["dead_producer_fail_s"] is None
            else bool(summary["dead_producer_failed"])
            and summary["dead_producer_fail_s"] <= GOAL_DEAD_PRODUCER_S
        ),
        "peak blocks after decode death <= in-flight blocks": (
            None if peak is None or inflight_blocks is None else peak <= inflight_blocks
        ),
    }
    if partition:
        goals["unreachable producer fails <= 2 s"] = (
            bool(partition["unreachable_producer_direct"]["failed"])
            and partition["unreachable_producer_direct"]["seconds"] <= GOAL_DEAD_PRODUCER_S
        )
    failures = Counter(
        (o.phase, o.status, _short(o.error)) for o in load.outcomes if o.status != "ok"
    )
    return {
        "summary": summary,
        "goals": goals,
        "by_phase": {phase: dict(counts) for phase, counts in by_phase.items()},
        "failure_kinds": [
            {"phase": phase, "status": status, "error": error, "count": count}
            for (phase, status, error), count in failures.most_common()
        ],
        "wrong_examples": wrong[:10],
        "truncated_examples": truncated[:10],
        "hung_examples": [asdict(o) for o in load.outcomes if o.status == "hung"][:10],
    }


def _blocks_for(reference: dict[tuple[str, int], Any], prompt: str, block_size: int) -> int:
    for (text, _), output in reference.items():
        if text == prompt:
            # Prefill holds the prompt's blocks (and the slot of its one sampled token).
            return math.ceil((len(output.prompt_token_ids) + 1) / block_size)
    return 0


def _short(error: str) -> str:
    """An error message without its ids and numbers, so that kinds group."""
    import re

    error = re.sub(r"cmpl-[0-9a-f]+|chaos-[\w-]+", "<id>", error)
    error = re.sub(r"\d+(\.\d+)?", "N", error)
    return error[:160]


def print_report(result: dict[str, Any], mode: str) -> None:
    s, goals = result["summary"], result["goals"]
    print(f"\nchaos benchmark ({mode})")
    rows = [
        (
            "requests (load + probes)",
            f"{s['requests']} ({s['load_requests']} + "
            f"{s['probe_requests']}), {s['streamed']} streamed",
            "",
        ),
        ("correct (token ids == colocated)", _fmt(s["correct"]), ""),
        ("typed failures (4xx/5xx, SSE error)", _fmt(s["typed_failures"]), ""),
        ("untyped failures", _fmt(s["untyped_failures"]), "0"),
        ("200s cut short (finish abort, right prefix)", _fmt(s["truncated_200s"]), ""),
        ("wrong", _fmt(s["wrong"]), "0: " + _verdict(goals["wrong == 0"])),
        (
            "hung (> router deadline + margin)",
            _fmt(s["hung"]),
            "0: " + _verdict(goals["hung == 0"]),
        ),
        ("client aborts", _fmt(s["client_aborts"]), ""),
        (
            f"leaked blocks ({DRAIN_GRACE_S:g} s after the load drained)",
            f"{_fmt(s['leaked_blocks'])} ("
            + ", ".join(f"{role} {_fmt(n)}" for role, n in s["leaked_by_daemon"].items())
            + ")",
            "0: " + _verdict(goals["leaked == 0"]),
        ),
        (
            "  still in use at the end (after leases ran out)",
            f"{_fmt(s['held_for_good'])} (at {s['seconds_until_final_blocks']:.1f} s)",
            "0: " + _verdict(goals["held for good == 0"]),
        ),
        (
            "  prefill leases expired (KV held to lease end)",
            _fmt(s["prefill_leases_expired"]),
            "since the prefill's last start",
        ),
        (
            "prefill restart: recovery from process start",
            _fmt(s["prefill_recovery_s"], " s"),
            "<= 2 s: " + _verdict(goals["prefill recovery <= 2 s (from process start)"]),
        ),
        (
            "  of which start-up / after ready",
            _pair(s["prefill_start_up_s"], s["prefill_recovery_after_ready_s"]),
            "<= 2 s after ready: " + _verdict(goals["prefill recovery <= 2 s (from ready)"]),
        ),
        (
            "decode restart: recovery from process start",
            _fmt(s["decode_recovery_s"], " s"),
            "<= 2 s: " + _verdict(goals["decode recovery <= 2 s (from process start)"]),
        ),
        (
            "  of which start-up / after ready",
            _pair(s["decode_start_up_s"], s["decode_recovery_after_ready_s"]),
            "<= 2 s after ready: " + _verdict(goals["decode recovery <= 2 s (from ready)"]),
        ),
        ("SIGSTOP: first success after SIGCONT", _fmt(s["sigstop_recovery_s"], " s"), ""),
        (
            "partition: first success after heal",
            _fmt(s["heal_recovery_s"], " s") if mode != "127.0.0.1" else "skipped (no --netns)",
            "",
        ),
        (
            "peak prefill blocks while decode dead",
            f"{_fmt(s['peak_prefill_blocks_after_decode_death'])} (in flight at kill: "
            f"{_fmt(s['inflight_blocks_at_decode_death'])}, held before: "
            f"{_fmt(s['prefill_blocks_before_decode_kill'])})",
            "<= in flight: "
            + _verdict(goals["peak blocks after decode death <= in-flight blocks"]),
        ),
        (
            "decode request to a dead producer fails in",
            _fmt(s["dead_producer_fail_s"], " s"),
            "<= 2 s: " + _verdict(goals["dead producer fails <= 2 s"]),
        ),
        (
            "router's answer while prefill is dead",
            _fmt(s["router_answer_while_prefill_dead_s"], " s"),
            "",
        ),
    ]
    if "unreachable producer fails <= 2 s" in goals:
        rows.append(
            (
                "decode request, producer partitioned, fails in",
                _fmt(s["unreachable_producer_fail_s"], " s"),
                "<= 2 s: " + _verdict(goals["unreachable producer fails <= 2 s"]),
            )
        )
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    print(f"{'metric':<{width}}  {'value':<{value_width}}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:<{value_width}}  {goal}".rstrip())
    print("\noutcomes by phase (phase at the request's start)")
    statuses = ("ok", "typed", "untyped", "aborted", "hung")
    print(f"{'phase':<20}" + "".join(f"{st:>9}" for st in statuses))
    for phase, counts in result["by_phase"].items():
        print(f"{phase:<20}" + "".join(f"{counts.get(st, 0):>9}" for st in statuses))
    if result["failure_kinds"]:
        print("\nfailures by kind (count, phase, status: message)")
        for kind in result["failure_kinds"][:15]:
            print(f"{kind['count']:>5}  {kind['phase']}, {kind['status']}: {kind['error']}")


# ------------------------------------------------------------------ main


async def _drain_and_check_leaks(
    args: argparse.Namespace, services: Services, settle_s: float
) -> dict[str, Any]:
    """Blocks in use on each daemon once the load drained, polled every 0.5 s until all are 0
    or ``settle_s`` passed. ``leaked``: what is still in use ``DRAIN_GRACE_S`` after the
    drain (the router's releases and the engines' next steps are done by then: anything left
    is held for nobody); ``held_for_good``: what is still in use at the end (leases ran out)."""
    addresses = {role: services.placement.address(role) for role in ("prefill", "decode")}
    started = time.monotonic()
    history: list[dict[str, Any]] = []
    after_grace: dict[str, int | None] | None = None
    held: dict[str, Any] = {}
    while True:
        elapsed = time.monotonic() - started
        now = {role: await blocks_in_use(address) for role, address in addresses.items()}
        history.append({"t_s": round(elapsed, 2), **now})
        zero = all(v == 0 for v in now.values())
        if after_grace is None and (elapsed >= DRAIN_GRACE_S or zero):
            after_grace = dict(now)
            # By request, what is held then (KVAdmin.ListTransfers): evidence for leftovers.
            held = {role: await held_transfers(address) for role, address in addresses.items()}
        if zero or elapsed > settle_s:
            break
        await asyncio.sleep(0.5)
    assert after_grace is not None
    return {
        "at_drain": history[0],
        "after_grace": after_grace,
        "leaked": _total(after_grace),
        "held_after_grace": held,
        "final": now,
        "held_for_good": _total(now),
        "seconds_to_final": time.monotonic() - started,
        "history": history,
    }


def _total(blocks: dict[str, int | None]) -> int | None:
    if any(v is None for v in blocks.values()):
        return None
    return sum(v for v in blocks.values() if v is not None)


async def _run(
    args: argparse.Namespace, services: Services, namespaces: Namespaces | None
) -> tuple[Load, Chaos, dict[str, Any], dict[str, Any]]:
    placement = services.placement
    base_url = f"http://{placement.address('router')}"
    load = Load(args, base_url, random.Random(args.seed))
    chaos = Chaos(args, services, load, namespaces)
    # Warm-up: one request must work before any chaos, or the figures mean nothing.
    await load.run(_warm_up_then_chaos(chaos))
    chaos.log(f"load drained: {len(load.outcomes)} requests")
    leaks = await _drain_and_check_leaks(args, services, args.kv_lease_s + 5.0)
    chaos.log(
        f"blocks in use after the drain: {leaks['after_grace']} after {DRAIN_GRACE_S:g} s, "
        f"{leaks['final']} after {leaks['seconds_to_final']:.1f} s"
    )
    for role, held in leaks["held_after_grace"].items():
        for transfer in held or []:
            chaos.log(f"  KVAdmin transfers on {role} then: {transfer}")
    statuses = {}
    for role in ("prefill", "decode"):
        statuses[role] = await daemon_status(placement.address(role))
    return load, chaos, leaks, statuses


async def _warm_up_then_chaos(chaos: Chaos) -> None:
    warm = await chaos.probe()
    if warm.status != "ok":
        raise ChaosAbort(f"the warm-up request failed ({warm.status}): {warm.error}")
    chaos.log(f"warm-up ok in {warm.elapsed_s:.2f} s; load starts")
    chaos.load.started.set()
    await chaos.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight (6)")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=1000,
        help="cap on load requests; the schedule's length bounds the run (1000)",
    )
    parser.add_argument(
        "--gap-s",
        type=float,
        default=8.0,
        help="seconds of plain load before, between and after the faults (8)",
    )
    parser.add_argument(
        "--abort-fraction",
        type=float,
        default=0.15,
        help="share of requests the client abandons mid-request (0.15)",
    )
    parser.add_argument("--stream-fraction", type=float, default=0.35)
    parser.add_argument(
        "--fail-pause-s",
        type=float,
        default=0.5,
        help="a load client pauses this long after a failed request (0.5)",
    )
    parser.add_argument("--stop-s", type=float, default=4.0, help="SIGSTOP length (4)")
    parser.add_argument(
        "--dead-s",
        type=float,
        default=1.0,
        help="how long decode stays dead before its restart begins (1)",
    )
    parser.add_argument("--partition-s", type=float, default=5.0, help="partition length (5)")
    parser.add_argument(
        "--kv-lease-s",
        type=float,
        default=20.0,
        help="the prefill's kv_lease_s (20); --stop-s must be shorter",
    )
    parser.add_argument(
        "--router-deadline-s",
        type=float,
        default=20.0,
        help="the router's --request-timeout-s (20)",
    )
    parser.add_argument(
        "--hang-margin-s",
        type=float,
        default=5.0,
        help="a request unanswered after deadline + margin is hung (5)",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="each service in its own network namespace (root); adds the partition and heal",
    )
    parser.add_argument(
        "--data-plane",
        choices=("rma", "tagged", "push"),
        default="rma",
        help="both daemons' UcxConnector data plane (rma)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="daemon and router logs (default: temp)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.stop_s >= args.kv_lease_s:
        parser.error("--stop-s must be shorter than --kv-lease-s")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (ip netns, veth pairs)")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvtransfer-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    namespaces = make_namespaces() if args.netns else None
    if namespaces is None:
        placement = local_placement()
    else:
        try:
            placement = namespaces.setup()
        except BaseException as exc:
            namespaces.teardown()
            print(f"could not set up the network namespaces: {exc}")
            return 2
    mode = "127.0.0.1"
    if namespaces is not None:
        mode = f"network namespaces ({type(namespaces).__name__}, switch {namespaces.switch})"
    if namespaces is None:
        print("no --netns: everything on 127.0.0.1; the partition/heal phase is SKIPPED")
    services = Services(args, placement, log_dir)
    started = time.monotonic()
    stopped: dict[str, Any] = {}
    try:
        try:
            for role in ("prefill", "decode", "router"):
                spawned, ready = services.start(role)
                print(f"{role} ready at {placement.address(role)} in {ready - spawned:.2f} s")
        except ServiceStartError as exc:
            print(f"could not start the services: {exc}\n(logs: {log_dir})")
            return 2
        try:
            load, chaos, leaks, statuses = asyncio.run(_run(args, services, namespaces))
        except ChaosAbort as exc:
            print(f"{exc}\n(logs: {log_dir})")
            return 2
    finally:
        stopped = services.stop_all()
        if namespaces is not None:
            namespaces.teardown()
    print(f"[{time.monotonic() - started:6.1f}s] stopped: {stopped}")
    print("colocated reference ...", flush=True)
    reference = colocated_reference(args.model, reference_keys(load.outcomes, chaos))
    result = summarize(args, load, chaos, reference, leaks, statuses, BLOCK_SIZE)
    result["summary"]["blocks_in_use_at_exit"] = {
        role: info.get("blocks_in_use_at_exit") for role, info in stopped.items()
    }
    print_report(result, mode)
    print(f"\nwall time {time.monotonic() - started:.0f} s; logs in {log_dir}")
    broken = [
        name
        for name in ("wrong == 0", "hung == 0", "leaked == 0", "held for good == 0")
        if not result["goals"][name]
    ]
    if args.json is not None:
        payload = {
            "benchmark": "chaos",
            "mode": mode,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            **result,
            "phases": chaos.report,
            "events": chaos.events,
            "leaks": leaks,
            "daemon_status_at_end": statuses,
            "stopped": stopped,
            "outcomes": [asdict(o) for o in load.outcomes],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    if broken:
        print(f"invariants broken: {', '.join(broken)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
