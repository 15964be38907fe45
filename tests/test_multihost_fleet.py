"""The router's fleet features across hosts (the ``netns`` tier): two prefill daemons and two
decode daemons, each in its own network namespace, the routers and the client in two more, all
on one switch. Every daemon publishes its KV cache events on its own address (the same port on
every host, as the pods of one Deployment do). One cluster is shared by the module; its routers,
all in the router namespace, differ in policy or fleet:

* one router per policy (``round_robin``, ``least_load``, ``power_of_two``, ``cache_aware``,
  the last with the prompt's token ids, ``--tokenizer``, and the daemons' KV events,
  ``--kv-events-port``), each over all four daemons;
* a fleet router (admin API on, behind a bearer token; ``round_robin``) that starts with one
  prefill and both decodes.

Checked:

* with every policy, completions through the router equal a colocated run, with the KV received
  across hosts rather than recomputed (round robin: every prefill and every decode serves);
  afterwards no daemon holds a KV block;
* ``cache_aware`` from KV events: a prompt computed by one prefill called directly (the router
  never saw it) reaches the router as that prefill's events (its index, ``/metrics``); the
  router then sends the prompt, and prompts extending it, to that prefill (the answer's
  ``kvtransfer.prefill``), which serves them from its cache (``cached_tokens``), each of the
  two prefills for its own prompt, with the colocated tokens;
* instances that come and go under a bounded concurrent load through the fleet router: the
  second prefill added (``POST /workers``), then the first prefill killed (SIGKILL) with a
  request in flight on it, then one decode removed (``DELETE /workers``) with requests in flight
  on it. (A request takes tens of milliseconds here, so each is stopped with SIGSTOP until the
  router has a request on it: the kill and the removal land in the middle of requests.) Every
  request either succeeds with the colocated tokens, the KV received, or ends with a typed 5xx
  answer naming the killed prefill, within the request deadline (no hang); the kill hits a
  request (retried on the other prefill, or failed); requests that were on the removed decode
  finish there; none sent after the kill is prefilled by the killed prefill, none sent after
  the removal is decoded by the removed decode, and the added prefill serves; afterwards
  requests succeed again, on the surviving instances, and the killed prefill is out of the
  picks; no surviving daemon holds a KV block (KVAdmin status, then their exit line). Runs
  last: it kills a daemon of the shared cluster.

Needs root and ``ip netns``; skipped with the reason otherwise, failed instead when
``KVTRANSFER_REQUIRE_NETNS=1`` (CI).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from netns_helpers.require import network
from netns_helpers.services import (
    admin_status,
    complete,
    generate_on,
    http_call,
    results,
    run_requests,
    start_daemon,
    start_router,
    start_together,
)
from netns_helpers.topology import Host, Network
from serve_helpers.daemons import BLOCK_SIZE, PROMPTS, colocated, exit_used_blocks
from waiting import wait_until

from kvtransfer.serve.launcher import ServiceProcess

pytestmark = [pytest.mark.deploy, pytest.mark.netns]

MAX_TOKENS = 8
# Small, as in test_multihost: a request caught by a dead prefill ends (typed) within seconds.
REQUEST_DEADLINE_S = 8.0
# The KV a prefill holds for a request whose decode never came is freed by its lease.
KV_EXTRA = {"transfer_timeout_s": 5, "kv_lease_s": 8, "handshake_timeout_s": 2}
# Each daemon is alone in its namespace: one port number serves on every host.
EVENTS_PORT = 5557
REPLAY_PORT = 5558
POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")
ADMIN_TOKEN = "multihost-fleet-admin-token"
# One prompt seeded on each prefill, outside the router: different from their first byte on, so
# they share no prefix block.
SEEDED = (
    "Zero: this prompt was computed by the first prefill, called directly, before any router.",
    "One: this prompt was computed by the second prefill, called directly, before any router.",
)
EXTENSION = " And then a question that nobody asked before?"
# The load while instances come and go: paced (a request takes tens of milliseconds here), long
# enough for the admin calls and the kill to land in its middle.
LOAD_REQUESTS = 48
LOAD_CONCURRENCY = 6
LOAD_DELAY_S = 0.15


@pytest.fixture(scope="module", autouse=True)
def _namespaces_available() -> None:
    """Skip (or fail) before any engine is loaded for the colocated reference."""
    network("probe").close()


@dataclass
class Cluster:
    net: Network
    prefills: list[tuple[Host, ServiceProcess]]
    decodes: list[tuple[Host, ServiceProcess]]
    routers: dict[str, ServiceProcess]
    # Starts with the first prefill and both decodes; admin API on (ADMIN_TOKEN).
    fleet: ServiceProcess
    client: Host
    # Daemons killed by a test: they wrote no exit line.
    killed: set[str] = field(default_factory=set)

    def daemons(self) -> list[tuple[Host, ServiceProcess]]:
        return [*self.prefills, *self.decodes]

    def addresses(self, pairs: list[tuple[Host, ServiceProcess]]) -> set[str]:
        return {process.address for _, process in pairs}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """Colocated tokens of `PROMPTS`, then of `SEEDED`, then of the first seeded prompt
    extended."""
    return colocated([*PROMPTS, *SEEDED, SEEDED[0] + EXTENSION], MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("multihost-fleet")
    token_file = logs / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    names = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    with network("fleet") as net:
        hosts = {name: net.add_host(name) for name in [*names, "router", "client"]}
        daemons: list[ServiceProcess] = []
        routers: list[ServiceProcess] = []
        killed: set[str] = set()
        try:
            daemons += start_together(
                *[_daemon_starter(hosts[name], role, logs) for name, role in names.items()]
            )
            pairs = [(hosts[name], process) for name, process in zip(names, daemons, strict=True)]
            prefills, decodes = pairs[:2], pairs[2:]
            everything = ([p for _, p in prefills], [d for _, d in decodes])
            starts: list[Callable[[], ServiceProcess]] = [
                _router_starter(hosts["router"], logs, policy, *everything, *_policy_flags(policy))
                for policy in POLICIES
            ]
            starts.append(
                _router_starter(
                    hosts["router"],
                    logs,
                    "fleet",
                    [prefills[0][1]],
                    everything[1],
                    "--admin-token-file",
                    str(token_file),
                    # Picks in turn: an instance stopped by the test gets its share of requests.
                    "--policy",
                    "round_robin",
                )
            )
            routers += start_together(*starts)
            cluster = Cluster(
                net,
                prefills,
                decodes,
                dict(zip(POLICIES, routers[: len(POLICIES)], strict=True)),
                routers[-1],
                hosts["client"],
                killed,
            )
            yield cluster
        finally:
            for process in [*routers, *daemons]:
                process.terminate()
    for process in daemons:
        if process.name not in killed:
            assert exit_used_blocks(process) == 0, process.log_tail()


def _daemon_starter(host: Host, role: str, logs: Path) -> Callable[[], ServiceProcess]:
    events = (
        "--kv-events-endpoint",
        f"tcp://{host.address}:{EVENTS_PORT}",
        "--kv-events-replay-endpoint",
        f"tcp://{host.address}:{REPLAY_PORT}",
    )
    return lambda: start_daemon(host, role, logs, *events, extra=KV_EXTRA)


def _router_starter(
    host: Host,
    logs: Path,
    name: str,
    prefills: list[ServiceProcess],
    decodes: list[ServiceProcess],
    *flags: str,
) -> Callable[[], ServiceProcess]:
    deadline = ("--request-timeout-s", str(REQUEST_DEADLINE_S))
    return lambda: start_router(
        host, logs, prefills, decodes, *deadline, *flags, name=f"router-{name}"
    )


def _policy_flags(policy: str) -> tuple[str, ...]:
    flags = ("--policy", policy)
    if policy != "cache_aware":
        return flags
    # The daemons' tokenizer (builtin model) and their KV events, on every instance's host.
    return (
        *flags,
        "--tokenizer", "builtin",
        "--kv-events-port", str(EVENTS_PORT),
        "--kv-events-replay-port", str(REPLAY_PORT),
        "--kv-block-size", str(BLOCK_SIZE),
    )  # fmt: skip


def _body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS}


def _tokens(result: dict[str, Any]) -> list[int]:
    assert result["status"] == 200, result
    return result["body"]["kvtransfer"]["token_ids"]


def _received_not_recomputed(result: dict[str, Any]) -> None:
    info = result["body"]["kvtransfer"]
    assert info["kv_blocks_received"] > 0 and info["num_recomputed_tokens"] == 0, info


# ------------------------------------------------------------------------------ policies


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_colocated_tokens_across_hosts(cluster, expected, policy):
    router = cluster.routers[policy]
    order = [0, 1, 2, 2, 1, 0]
    runner = run_requests(
        cluster.client, router.address, [_body(PROMPTS[i]) for i in order], concurrency=2
    )
    answers = results(runner, timeout_s=120)
    prefills, decodes = set(), set()
    for prompt_index, result in zip(order, answers, strict=True):
        assert _tokens(result) == expected[prompt_index], result
        _received_not_recomputed(result)
        info = result["body"]["kvtransfer"]
        prefills.add(info["prefill"])
        decodes.add(info["decode"])
    assert prefills <= cluster.addresses(cluster.prefills), prefills
    assert decodes <= cluster.addresses(cluster.decodes), decodes
    if policy == "round_robin":
        assert prefills == cluster.addresses(cluster.prefills), prefills
        assert decodes == cluster.addresses(cluster.decodes), decodes
    print(f"{policy}: prefills {sorted(prefills)}, decodes {sorted(decodes)}")
    _wait_until_none_used(cluster.client, [process for _, process in cluster.daemons()])


# --------------------------------------------------------------- cache-aware from events


def test_cache_aware_follows_kv_events_across_hosts(cluster, expected):
    router = cluster.routers["cache_aware"]
    client = cluster.client
    seeded_blocks = []
    for (_, prefill), text in zip(cluster.prefills, SEEDED, strict=True):
        before = _indexed_blocks(client, router.address, prefill.address, "events")
        # Outside the router: only the prefill's KV events can tell the router it holds it.
        seeded = generate_on(client, prefill.address, text, 1)
        assert seeded["finish_reason"] in ("length", "stop") and not seeded["error"], seeded
        blocks = seeded["num_prompt_tokens"] // BLOCK_SIZE
        assert blocks >= 4, seeded
        seeded_blocks.append(blocks)
        wait_until(
            lambda a=prefill.address, b=before, n=blocks: (
                _indexed_blocks(client, router.address, a, "events") >= b + n
            ),
            f"{prefill.address}'s KV events for the seeded prompt indexed by the router",
            30,
            interval=0.2,
        )
    # Both prefills scored from their events (not from the router's own picks).
    precise = {
        p.address: _metric(client, router.address, "kvtransfer_router_index_precise", p.address)
        for _, p in cluster.prefills
    }
    assert set(precise.values()) == {1.0}, precise
    # Each prompt, and one extending the first, goes to the prefill that holds it, which
    # computes only what it lacks.
    prompts = [SEEDED[0], SEEDED[1], SEEDED[0] + EXTENSION]
    holders = [cluster.prefills[0][1], cluster.prefills[1][1], cluster.prefills[0][1]]
    held = [seeded_blocks[0], seeded_blocks[1], seeded_blocks[0]]
    answers = complete(client, router.address, [_body(p) for p in prompts])
    for index, (result, holder, blocks) in enumerate(zip(answers, holders, held, strict=True)):
        assert _tokens(result) == expected[len(PROMPTS) + index], result
        _received_not_recomputed(result)
        assert result["body"]["kvtransfer"]["prefill"] == holder.address, result
        cached = result["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (blocks - 1) * BLOCK_SIZE, (blocks, result["body"]["usage"])
        print(f"{prompts[index]!r}: {blocks} blocks seeded, {cached} tokens cached")
    _wait_until_none_used(client, [process for _, process in cluster.daemons()])


def _indexed_blocks(client: Host, url: str, address: str, source: str) -> float:
    """The router's index size for the prefill at ``address`` (its /metrics), 0 before it is
    listed."""
    return _metric(client, url, "kvtransfer_router_index_blocks", address, source=source) or 0.0


def _metric(client: Host, url: str, name: str, address: str, **labels: str) -> float | None:
    """The router's ``name`` for the prefill at ``address`` (its /metrics; ``None``: not
    listed)."""
    status, text = http_call(client, "GET", f"{url}/metrics")
    assert status == 200, text
    wanted = {"address": address, "role": "prefill", **labels}
    for sample, found, value in _samples(text):
        if sample == name and found == wanted:
            return value
    return None


def _prefill_retries(client: Host, url: str) -> float:
    """Prefill phases the router retried on another instance (its /metrics)."""
    status, text = http_call(client, "GET", f"{url}/metrics")
    assert status == 200, text
    return sum(
        value
        for name, labels, value in _samples(text)
        if name == "kvtransfer_router_retries_total" and labels.get("role") == "prefill"
    )


_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            yield match.group(1), dict(_LABEL.findall(match.group(2))), float(match.group(3))


# ------------------------------------------------------- instances coming and going (last)


def test_instances_come_and_go_under_load(cluster, expected):
    """Runs last: it kills the first prefill."""
    client, fleet = cluster.client, cluster.fleet
    (p0_host, p0), (_, p1) = cluster.prefills
    (_, d0), (_, d1) = cluster.decodes
    workers = _workers(client, fleet.address)
    assert set(workers) == {p0.address, d0.address, d1.address}, workers

    order = [i % len(PROMPTS) for i in range(LOAD_REQUESTS)]
    runner = run_requests(
        client,
        fleet.address,
        [_body(PROMPTS[i]) for i in order],
        concurrency=LOAD_CONCURRENCY,
        delay_s=LOAD_DELAY_S,
        timeout_s=REQUEST_DEADLINE_S + 30,
    )
    try:
        wait_until(
            lambda: _workers(client, fleet.address)[p0.address]["picks"] >= 3,
            "the load under way",
            60,
            interval=0.1,
        )
        status, added = _admin(client, fleet.address, "POST", "/workers", p1.address, "prefill")
        assert status == 201, added
        assert (added["address"], added["role"], added["source"]) == (
            p1.address,
            "prefill",
            "admin",
        )
        assert added["healthy"] and added["pickable"], added
        # A request here takes tens of milliseconds: the prefill is stopped (SIGSTOP) until the
        # router has a request on it, so that the kill lands in the middle of requests.
        os.kill(p0.pid, signal.SIGSTOP)
        try:
            _wait_in_flight(client, fleet.address, p0.address)
        finally:
            p0.kill()
            cluster.killed.add(p0.name)
        killed_at = time.monotonic()
        # Likewise the decode is removed with requests on it (stopped until it has some, then
        # removed, then let go on): they finish there.
        os.kill(d1.pid, signal.SIGSTOP)
        try:
            _wait_in_flight(client, fleet.address, d1.address)
            status, removed = _admin(client, fleet.address, "DELETE", f"/workers/{d1.address}")
            removed_at = time.monotonic()
        finally:
            os.kill(d1.pid, signal.SIGCONT)
        assert status == 200, removed
        assert (removed["address"], removed["role"]) == (d1.address, "decode"), removed
        assert removed["in_flight"] >= 1, removed
    finally:
        outcomes = results(runner, timeout_s=180)
    assert len(outcomes) == len(order)
    summary = [
        (r["status"], r["elapsed_s"], _served_by(r), _when(r, killed_at, removed_at))
        for r in outcomes
    ]
    print("(status, seconds, route, sent: 0 before the kill, 1 after, 2 after the removal)")
    print(summary)
    for result in outcomes:
        # Never a hang: every answer within the router's deadline (plus scheduling slack).
        assert result["elapsed_s"] <= REQUEST_DEADLINE_S + 10, result
        if result["status"] == 200:
            assert _tokens(result) == expected[order[result["index"]]], result
            _received_not_recomputed(result)
            info = result["body"]["kvtransfer"]
            assert info["prefill"] in (p0.address, p1.address), info
            assert info["decode"] in (d0.address, d1.address), info
            if result["started_at"] > killed_at:
                assert info["prefill"] == p1.address, result
            if result["started_at"] > removed_at:
                assert info["decode"] == d0.address, result
            continue
        assert 500 <= result["status"] < 600, result
        error = result["body"]["error"]
        assert error["type"] and error["message"], result
        # Only the killed prefill failed anything: not the removed decode, nor the added prefill.
        # The kill can also land while a decode reads the KV p0 holds (seen once in CI): that
        # decode's load fails on p0's reset connection, and its message names p0 as the
        # producer it read from.
        assert f"{p0_host.address}:" in error["message"], result
    # The kill hit a request: retried on the other prefill (it failed having sent nothing) or
    # failed (typed, above).
    failed = [r for r in outcomes if r["status"] != 200]
    retried = _prefill_retries(client, fleet.address)
    assert failed or retried >= 1, summary
    served = [_served_by(r) for r in outcomes]
    # The added prefill served.
    assert any(route.startswith(f"{p1.address}->") for route in served), summary
    # The requests on the removed decode when it was removed finished there: answered after the
    # removal (it was stopped until then), decoded by it.
    held = [
        r
        for r in outcomes
        if r["status"] == 200
        and r["body"]["kvtransfer"]["decode"] == d1.address
        and r["started_at"] + r["elapsed_s"] > removed_at
    ]
    assert len(held) >= removed["in_flight"], (removed, summary)

    # Afterwards: served again, on the surviving instances of the fleet.
    answers = complete(client, fleet.address, [_body(p) for p in PROMPTS])
    for index, result in enumerate(answers):
        assert _tokens(result) == expected[index], result
        _received_not_recomputed(result)
        info = result["body"]["kvtransfer"]
        assert (info["prefill"], info["decode"]) == (p1.address, d0.address), info

    def without_p0() -> dict[str, dict[str, Any]] | None:
        workers = _workers(client, fleet.address)
        return None if workers[p0.address]["pickable"] else workers

    workers = wait_until(without_p0, "the killed prefill out of the picks", 30, interval=0.2)
    assert set(workers) == {p0.address, p1.address, d0.address}, workers
    assert workers[p1.address]["source"] == "admin", workers
    # Nothing left held: KV the dead prefill's requests left on the others is freed (by the
    # router's release, or the lease).
    _wait_until_none_used(client, [p1, d0, d1], timeout_s=KV_EXTRA["kv_lease_s"] + 30)


def _wait_in_flight(client: Host, url: str, address: str) -> None:
    wait_until(
        lambda: _workers(client, url)[address]["in_flight"] > 0,
        f"a request in flight on {address}",
        30,
        interval=0.05,
    )


def _when(result: dict[str, Any], killed_at: float, removed_at: float) -> int:
    return (result["started_at"] > killed_at) + (result["started_at"] > removed_at)


def _served_by(result: dict[str, Any]) -> str:
    if result["status"] != 200:
        return "-"
    info = result["body"]["kvtransfer"]
    return f"{info['prefill']}->{info['decode']}"


def _workers(client: Host, url: str) -> dict[str, dict[str, Any]]:
    status, answer = _admin(client, url, "GET", "/workers")
    assert status == 200, answer
    return {worker["address"]: worker for worker in answer["workers"]}


def _admin(
    client: Host,
    url: str,
    method: str,
    path: str,
    address: str | None = None,
    role: str | None = None,
) -> tuple[int, Any]:
    body = {"address": address, "role": role} if address is not None else None
    return http_call(client, method, f"{url}{path}", body, token=ADMIN_TOKEN)


def _wait_until_none_used(
    client: Host, daemons: list[ServiceProcess], timeout_s: float = 30.0
) -> None:
    """Until no daemon of ``daemons`` has a KV block in use (KVAdmin status, asked from
    ``client``)."""

    def used() -> dict[str, int]:
        return {d.name: admin_status(client, d.address)["num_used_blocks"] for d in daemons}

    wait_until(
        lambda: not any(used().values()),
        lambda: f"no KV block in use (used: {used()})",
        timeout_s,
        interval=0.5,
    )
