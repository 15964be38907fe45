"""P/D across hosts, with test hosts in network namespaces (the ``netns`` tier).

Three prefill daemons (1x1, TP2, PP2), a decode daemon (1x1), the router and the client each
run in their own namespace on one switch; every namespace also holds an unrouted interface
that UCX must never advertise or dial. KV moves between namespaces over TCP: UCX may not use
shared memory there (see `kvtransfer.transport.locality`). Every test that moves KV runs on
both data planes (``data_plane`` in both daemons' ``kv_connector_extra_config``, one cluster
per plane): ``rma`` (the decode reads the prefill's KV one-sided, UCX gets over TCP served by
the prefill's UCX worker), ``tagged`` (each pull answered by the prefill) and ``push`` (the
decode asks, each prefill worker writes with UCX puts over TCP). Checked, per plane:

* completions through the router equal a colocated run, with each prefill (1x1, TP2, PP2 ->
  decode 1x1) serving, and the KV received rather than recomputed;
* every socket listens on its daemon's configured address only (``ss`` in each namespace);
* UCX neither advertises nor dials the unrouted interface: after KV moved from every prefill
  worker, UCX listens (what it advertises to peers) on each host's KV address only, the decode
  holds a TCP connection from its KV address to every prefill worker's UCX listener, and no
  host has a socket on, or ever looked up a link-layer address for, any unrouted address;
* (pull planes) a partition of the decode host and then of a prefill host in the middle of a bounded
  load: while cut off, requests end in typed 5xx answers within the request deadline; with one of
  three prefills cut off, only requests sent to it may fail, and the other two serve requests sent
  during the partition; a decode request whose KV is on the cut-off prefill fails typed
  (``ProducerUnreachable``, naming it) within the liveness probes' bound, far below the transfer
  timeout; every request sent a health interval plus a second after the heal succeeds with the right
  tokens (nothing the partition broke is used again: a connection, an endpoint, a router channel);
  at the end no daemon holds a KV block;
* a partition during reads (a prefill, a decode, their own namespaces, policy ``fail`` and
  ``recompute``): the prefill's link shaped so that a long prompt's KV takes seconds to cross,
  and cut (its switch port down) while the decode lists the load as under way and KV the
  prefill sent is unacknowledged on its UCX sockets (still unacknowledged after the cut: the
  read was mid-transfer). The load fails within seconds, not at the transfer timeout
  (``ProducerUnreachable``; or recomputed, to the colocated tokens), the decode serves the same
  prompt, read from the same prefill, once the link is back, and neither side holds a block.
  Push: the decode's answer waits for the producer's writer to stop, up to the transfer timeout
  (bytes queued on the cut link could land after the heal), and is typed all the same.

Once, on the default plane: with everything on 127.0.0.1 in a namespace holding other
addresses too, nothing listens anywhere else.

Needs root and ``ip netns`` (the partition during reads also ``tc`` with its token bucket);
skipped with the reason otherwise, failed instead when ``KVTRANSFER_REQUIRE_NETNS=1`` (CI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from netns_helpers.require import network
from netns_helpers.services import (
    admin_status,
    admin_transfers,
    complete,
    generate_on,
    results,
    run_requests,
    start_daemon,
    start_router,
    start_together,
)
from netns_helpers.topology import Host, Network
from serve_helpers.daemons import PROMPTS, colocated, exit_used_blocks
from waiting import wait_until

from kvtransfer.connectors.ucx.liveness import (
    CONNECT_TIMEOUT_S,
    PROBE_INTERVAL_S,
    TIMEOUT_STRIKES,
)
from kvtransfer.router.config import RouterConfig
from kvtransfer.serve.launcher import ServiceProcess

pytestmark = [pytest.mark.deploy, pytest.mark.netns]

MAX_TOKENS = 8
# Small, so that a partition is felt (and healed from) within seconds; a partition outlasts
# the request deadline, so requests caught in it end (typed) before it heals.
REQUEST_DEADLINE_S = 8.0
KV_EXTRA = {"transfer_timeout_s": 5, "kv_lease_s": 8, "handshake_timeout_s": 2}
PARTITION_S = 10.0
# A load from a partitioned producer fails typed once the liveness probes called it
# unreachable: the first probe after PROBE_INTERVAL_S, then TIMEOUT_STRIKES connects timing out
# PROBE_INTERVAL_S apart; plus a second of slack for a loaded machine. Far below the transfer
# timeout and the request deadline, which ended such a load on the one-sided data plane.
UNREACHABLE_WITHIN_S = (
    PROBE_INTERVAL_S + TIMEOUT_STRIKES * (CONNECT_TIMEOUT_S + PROBE_INTERVAL_S) + 1.0
)
assert UNREACHABLE_WITHIN_S < KV_EXTRA["transfer_timeout_s"] < REQUEST_DEADLINE_S
# After a heal the router takes the host back at its next health check (every
# health_interval_s, sooner while one is out) once its channel reconnected (attempts at most a
# health interval apart, each bounded): requests sent this long after the heal all succeed.
HEALTH_INTERVAL_S = RouterConfig.__dataclass_fields__["health_interval_s"].default
HEALED_WITHIN_S = HEALTH_INTERVAL_S + 1.0
# The data planes (`UcxConnector` ``data_plane``): one-sided reads (UCX gets over TCP, served
# by the producer's UCX worker), tagged pulls (each answered by the producer) and pushes (UCX
# puts over TCP by the producer's workers).
DATA_PLANES = ("rma", "tagged", "push")
# Workers (so UCX agents) of each daemon.
WORKERS = {"p11": 1, "ptp2": 2, "ppp2": 2, "decode": 1}


@pytest.fixture(scope="module", autouse=True)
def _namespaces_available() -> None:
    """Skip (or fail) before any engine is loaded for the colocated reference."""
    network("probe").close()


@dataclass
class Cluster:
    data_plane: str
    net: Network
    prefills: dict[str, tuple[Host, ServiceProcess]]
    decode: tuple[Host, ServiceProcess]
    router: tuple[Host, ServiceProcess]
    client: Host

    @property
    def url(self) -> str:
        return self.router[1].address

    def daemons(self) -> list[tuple[Host, ServiceProcess]]:
        return [*self.prefills.values(), self.decode]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return colocated(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=DATA_PLANES)
def data_plane(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, data_plane) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp(f"multihost-{data_plane}")
    extra = {**KV_EXTRA, "data_plane": data_plane}
    with network("mh") as net:
        shapes = {"p11": (), "ptp2": ("--tp", "2"), "ppp2": ("--pp", "2")}
        hosts = {name: net.add_host(name) for name in [*shapes, "decode", "router", "client"]}
        processes: list[ServiceProcess] = []
        try:
            starts: list[Callable[[], ServiceProcess]] = [
                _starter(hosts[name], "prefill", logs, flags, extra)
                for name, flags in shapes.items()
            ]
            starts.append(_starter(hosts["decode"], "decode", logs, (), extra))
            processes += start_together(*starts)
            prefills = dict(zip(shapes, processes[:3], strict=True))
            decode = processes[3]
            router = start_router(
                hosts["router"],
                logs,
                list(prefills.values()),
                [decode],
                "--request-timeout-s",
                str(REQUEST_DEADLINE_S),
                # The tests spread concurrent requests over every prefill by taking turns.
                "--policy",
                "round_robin",
            )
            processes.append(router)
            yield Cluster(
                data_plane,
                net,
                {name: (hosts[name], process) for name, process in prefills.items()},
                (hosts["decode"], decode),
                (hosts["router"], router),
                hosts["client"],
            )
        finally:
            for process in reversed(processes):
                process.terminate()
    for process in processes[:4]:
        assert exit_used_blocks(process) == 0, process.log_tail()


def _starter(
    host: Host, role: str, logs, flags: tuple[str, ...], extra: dict[str, Any]
) -> Callable[[], ServiceProcess]:
    return lambda: start_daemon(host, role, logs, *flags, extra=extra)


def _body(prompt_index: int) -> dict[str, Any]:
    return {"prompt": PROMPTS[prompt_index], "max_tokens": MAX_TOKENS}


def _tokens(result: dict[str, Any]) -> list[int]:
    assert result["status"] == 200, result
    return result["body"]["kvtransfer"]["token_ids"]


def test_completions_across_hosts_equal_colocated(cluster, expected):
    # Rotated so that every prefill (round-robin) serves every prompt.
    order = [0, 1, 2, 1, 2, 0, 2, 0, 1]
    answers = complete(cluster.client, cluster.url, [_body(i) for i in order])
    served: dict[str, set[int]] = {}
    for prompt_index, result in zip(order, answers, strict=True):
        assert _tokens(result) == expected[prompt_index]
        info = result["body"]["kvtransfer"]
        assert info["kv_blocks_received"] > 0 and info["num_recomputed_tokens"] == 0
        served.setdefault(info["prefill"], set()).add(prompt_index)
    addresses = {process.address for _, process in cluster.prefills.values()}
    assert set(served) == addresses, served
    decode = cluster.decode[1]
    counters = admin_status(cluster.client, decode.address)["counters"]
    assert counters["kv_tokens_recomputed"] == 0 and counters["kv_blocks_received"] > 0
    # Across hosts one-sided reads are UCX's: the status names the protocol it picked (issue
    # 36), and a tagged decode reads nothing one-sided.
    picked = [name for name in counters if name.startswith("ucx_protocol:get host: ")]
    if cluster.data_plane == "rma":
        assert len(picked) == 1 and "tcp/" in picked[0] and counters[picked[0]] >= 1, counters
    else:
        assert picked == [], counters
    pushed = counters["kv_bytes_received_pushed"]
    if cluster.data_plane == "push":
        # Every load was written by a prefill worker (UCX puts over TCP, as its status says).
        assert pushed == counters["kv_bytes_received"] > 0, counters
        for _, prefill in cluster.prefills.values():
            theirs = admin_status(cluster.client, prefill.address)["counters"]
            puts = [name for name in theirs if name.startswith("ucx_protocol:put host: ")]
            assert puts and all("tcp/" in name for name in puts), theirs
    else:
        assert pushed == 0, counters


def test_every_listener_is_on_the_configured_address(cluster):
    for host, _ in [*cluster.daemons(), cluster.router]:
        sockets = cluster.net.listening(host)
        assert sockets, f"nothing listens in {host.namespace}"
        for address, owner in sockets:
            # TP/PP worker processes of one daemon talk over gloo on loopback (see
            # worker_process: GLOO_SOCKET_IFNAME=lo); nothing else may listen off the address.
            assert address in (host.address, "127.0.0.1"), (host.name, address, owner)
        addresses = {address for address, _ in sockets}
        if host.name in ("p11", "decode", "router"):
            assert addresses == {host.address}, (host.name, sockets)


def test_ucx_neither_advertises_nor_dials_the_unrouted_interface(cluster, expected):
    # Round-robin: three requests, one per prefill, so KV moved from every prefill worker.
    answers = complete(cluster.client, cluster.url, [_body(i) for i in range(3)])
    for index, result in enumerate(answers):
        assert _tokens(result) == expected[index]
    prefills = {process.address for _, process in cluster.prefills.values()}
    assert {result["body"]["kvtransfer"]["prefill"] for result in answers} == prefills
    hosts = cluster.net.hosts
    kv_addresses = {host.address for host in hosts}
    unrouted = {host.unrouted_address for host in hosts}
    ucx = {
        host.name: _ucx_listeners(cluster.net, host, process) for host, process in cluster.daemons()
    }
    for host, _ in cluster.daemons():
        listeners = ucx[host.name]
        # One UCX listener per worker at least, each on the KV address: what peers are told.
        assert len(listeners) >= WORKERS[host.name], (host.name, listeners)
        assert {address for address, _ in listeners} == {host.address}, (host.name, listeners)
    for host in hosts:
        connections = cluster.net.connections(host)
        on_unrouted = [c for c in connections if unrouted & {c.local_address, c.peer_address}]
        assert on_unrouted == [], (host.name, on_unrouted)
        # A dial of an unrouted address, even one that failed at once, leaves its neighbour
        # entry (ARP on the unrouted interface): only KV addresses were ever sent to.
        neighbours = cluster.net.neighbours(host)
        assert set(neighbours) <= kv_addresses, (host.name, neighbours)
    # The KV did cross the network between KV addresses: the decode connected from its KV
    # address to every prefill worker's UCX listener.
    decode_host, _ = cluster.decode
    dialed = {
        (c.peer_address, c.peer_port)
        for c in cluster.net.connections(decode_host)
        if c.state == "ESTAB" and c.local_address == decode_host.address
    }
    for name in cluster.prefills:
        missing = set(ucx[name]) - dialed
        assert not missing, (name, missing, dialed)


def _ucx_listeners(net: Network, host: Host, process: ServiceProcess) -> list[tuple[str, int]]:
    """The daemon's listening sockets that are neither its gRPC, KV handshake nor metrics
    server, nor on loopback (gloo between TP/PP workers): its workers' UCX listeners."""
    services = _service_ports(process)
    return [
        (address, port)
        for address, port, _ in net.listeners(host)
        if port not in services and address != "127.0.0.1"
    ]


def _service_ports(process: ServiceProcess) -> set[int]:
    """The ports of the daemon's gRPC, KV handshake and metrics servers."""
    services = {_port(process.address), process.ready["metrics_port"]}
    if process.ready.get("kv_handshake"):
        services.add(_port(process.ready["kv_handshake"]))
    return services


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_loopback_only_binds_loopback_in_a_namespace_with_other_addresses(tmp_path, expected):
    with network("lo") as net:
        host = net.add_host("solo")
        local = "127.0.0.1"
        processes: list[ServiceProcess] = []
        try:
            processes += start_together(
                lambda: start_daemon(host, "prefill", tmp_path, "--tp", "2", bind=local),
                lambda: start_daemon(host, "decode", tmp_path, bind=local),
            )
            router = start_router(host, tmp_path, processes[:1], processes[1:2], bind=local)
            processes.append(router)
            (answer,) = complete(host, processes[2].address, [_body(1)])
            assert _tokens(answer) == expected[1]
            sockets = net.listening(host)
            # prefill: gRPC, kv_port, metrics, 2 UCX workers; decode: gRPC, metrics, UCX; router.
            assert len(sockets) >= 8, sockets
            assert {address for address, _ in sockets} == {local}, sockets
        finally:
            for process in reversed(processes):
                process.terminate()
    assert [exit_used_blocks(p) for p in processes[:2]] == [0, 0]


# One plane: what a partition of a whole host does to the router and to requests does not
# depend on the plane, and each plane's own failure under a partition (a producer cut off
# mid-read or mid-write) is `test_a_partition_during_reads_...` (90 s less of CI).
@pytest.mark.parametrize("data_plane", ["rma"], scope="module")
def test_partitions_fail_typed_then_heal(cluster, expected):
    # The only decode daemon cut off: requests fail (typed, naming it) until it is back.
    decode_host, _ = cluster.decode
    load = _partition_under_load(cluster, decode_host, expected)
    assert load.failures, f"cutting off the decode failed no request: {load.summary}"
    for result in load.failures:
        assert _names(result, decode_host), result
    _wait_until_served(cluster, expected, lambda info: True)
    # One of three prefills cut off: only requests sent to it may fail (typed, naming it and
    # no other prefill); the two others serve what is sent meanwhile. Once healed it serves
    # again and decode pulls from it again.
    prefill_host, prefill = cluster.prefills["p11"]
    healthy = {name: pair for name, pair in cluster.prefills.items() if name != "p11"}
    # And a decode request whose KV is on the cut-off prefill (prefilled just before the cut)
    # fails typed, naming it, as soon as the liveness probes call it unreachable.
    request_id = f"cut-off-producer-{cluster.data_plane}"
    seeded = generate_on(
        cluster.client,
        prefill.address,
        PROMPTS[0],
        1,
        request_id=request_id,
        params={"do_remote_decode": True},
    )
    assert seeded["kv_transfer_params"], seeded
    direct: list[dict[str, Any]] = []

    def decode_from_the_cut_off_prefill() -> None:
        _, decode = cluster.decode
        direct.append(
            generate_on(
                cluster.client,
                decode.address,
                PROMPTS[0],
                MAX_TOKENS,
                request_id=request_id,
                params=seeded["kv_transfer_params"],
            )
        )

    load = _partition_under_load(
        cluster, prefill_host, expected, during=decode_from_the_cut_off_prefill
    )
    (answer,) = direct
    assert answer["finish_reason"] == "error", answer
    assert "ProducerUnreachable" in answer["error"], answer
    assert f"{prefill_host.address}:" in answer["error"], answer
    assert answer["elapsed_s"] < UNREACHABLE_WITHIN_S, answer
    for result in load.failures:
        assert _names(result, prefill_host), result
        assert not any(_names(result, host) for host, _ in healthy.values()), result
    served = {r["body"]["kvtransfer"]["prefill"] for r in load.during() if r["status"] == 200}
    assert {process.address for _, process in healthy.values()} <= served, load.summary
    _wait_until_served(cluster, expected, lambda info: info["prefill"] == prefill.address)
    _wait_until_no_blocks_used(cluster)


@dataclass
class Load:
    """The answers of a load run with a host cut off from ``cut_at`` to ``healed_at``."""

    outcomes: list[dict[str, Any]]
    cut_at: float
    healed_at: float

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.outcomes if r["status"] != 200]

    def during(self) -> list[dict[str, Any]]:
        """The requests sent while the host was cut off (one monotonic clock for all hosts)."""
        return [r for r in self.outcomes if self.cut_at <= r["started_at"] < self.healed_at]

    @property
    def summary(self) -> list[tuple[int, float, bool]]:
        """(status, seconds, sent while cut off) of each request."""
        during = {r["index"] for r in self.during()}
        return [(r["status"], r["elapsed_s"], r["index"] in during) for r in self.outcomes]


def _names(result: dict[str, Any], host: Host) -> bool:
    """Whether a failed answer names a daemon of ``host`` (as the daemon that failed, or as
    the producer a decode could not load from)."""
    return f"{host.address}:" in result["body"]["error"]["message"]


def _partition_under_load(
    cluster: Cluster,
    host: Host,
    expected: list[list[int]],
    during: Callable[[], None] | None = None,
) -> Load:
    """A bounded load (paced requests, a few at once) with ``host`` cut off in the middle
    (``during`` runs right after the cut). Requests sent `HEALED_WITHIN_S` after the heal or
    later all succeed: the partition leaves nothing broken behind (a connection, an endpoint,
    a router channel in back-off)."""
    bodies = [_body(i % len(PROMPTS)) for i in range(40)]
    before = _decode_calls(cluster)
    runner = run_requests(
        cluster.client,
        cluster.url,
        bodies,
        concurrency=8,
        delay_s=0.5,
        timeout_s=REQUEST_DEADLINE_S + 30,
    )
    try:
        wait_until(
            lambda: _decode_calls(cluster) >= before + 3, "the load under way", 60, interval=0.2
        )
        cluster.net.partition(host)
        cut_at = time.monotonic()
        if during is not None:
            during()
        # Not synchronisation: how long the host stays cut off is the fault under test.
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))
    finally:
        cluster.net.heal(host)
    healed_at = time.monotonic()
    outcomes = results(runner, timeout_s=120)
    assert len(outcomes) == len(bodies)
    for result in outcomes:
        # Never a hang: every answer comes within the router's deadline (plus scheduling slack).
        assert result["elapsed_s"] <= REQUEST_DEADLINE_S + 5, result
        if result["status"] == 200:
            assert _tokens(result) == expected[result["index"] % len(PROMPTS)]
            continue
        assert 500 <= result["status"] < 600, result
        error = result["body"]["error"]
        assert "daemon" in error["message"] and error["type"], result
    done = Load(outcomes, cut_at, healed_at)
    print(f"{host.name} cut off for {PARTITION_S} s: (status, seconds, during) {done.summary}")
    healed = [r for r in outcomes if r["started_at"] >= healed_at + HEALED_WITHIN_S]
    assert len(healed) >= 3, f"too few requests sent after the heal: {done.summary}"
    for result in healed:
        assert result["status"] == 200, (
            f"sent {result['started_at'] - healed_at:.2f} s after the heal",
            result,
        )
    return done


def _wait_until_served(
    cluster: Cluster,
    expected: list[list[int]],
    wanted: Callable[[dict[str, Any]], bool],
    timeout_s: float = 60.0,
) -> None:
    """Requests until one answer satisfies ``wanted``; every 200 must carry the right tokens."""
    last: list[Any] = [None]

    def served() -> bool:
        for result in complete(cluster.client, cluster.url, [_body(i) for i in range(3)]):
            last[0] = result
            if result["status"] == 200:
                assert _tokens(result) == expected[result["index"]]
                if wanted(result["body"]["kvtransfer"]):
                    return True
        return False

    wait_until(served, lambda: f"healed (last answer {last[0]})", timeout_s, interval=0.5)


def _decode_calls(cluster: Cluster) -> int:
    _, decode = cluster.decode
    return admin_status(cluster.client, decode.address)["counters"]["requests_started"]


def _wait_until_no_blocks_used(cluster: Cluster, timeout_s: float = 60.0) -> None:
    # KV held for requests whose decode failed is released by the router or by its lease.
    _wait_until_none_used(cluster.client, [process for _, process in cluster.daemons()], timeout_s)


def _wait_until_none_used(client: Host, daemons: list[ServiceProcess], timeout_s: float) -> None:
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


# ---------------------------------------------------------------- a partition during reads

# Long enough that the probes decide, not the timeout: a load that ends well within it was
# ended by the liveness probes (`kvtransfer.connectors.ucx.liveness`), as in test_liveness.
READ_EXTRA = {"transfer_timeout_s": 60, "kv_lease_s": 15, "handshake_timeout_s": 2}
# 1110 tokens: ~1.1 MB of KV (4 layers x K,V x 2 heads x 16 x float32 = 1 KiB a token), which
# the prefill's link, shaped to READ_RATE (125 kB/s), takes about 9 s to send: seconds to see
# the read under way and cut it, even on a loaded machine. (It is cut, so this costs nothing.)
LONG_PROMPT = PROMPTS[2] * 5
READ_RATE = "1mbit"
# Far below the transfer timeout, far above what the probes need (~1-1.5 s to call a silent
# host unreachable).
ANSWERED_WITHIN_S = 15.0
# Push: the decode learns as fast that the producer is unreachable, but the producer's writer
# still counts on its blocks (what sat in the cut link may land once it heals): the decode
# keeps them, and the request, until that writer says it stopped or a transfer timeout passed
# (`pushes.PushedLoad.end`), when the producer's own push deadline has passed too and its
# writer has given up and reset its endpoint. A shorter timeout than the pull planes' keeps
# this test short; the shaped transfer is cut long before it.
PUSH_READ_EXTRA = {**READ_EXTRA, "transfer_timeout_s": 12}
PUSH_ANSWERED_WITHIN_S = 12.0 + 8.0
# KV sent by the prefill and not yet acknowledged by the decode (its UCX sockets' Send-Q) when
# the link is cut: about 0.5 s of transfer at READ_RATE, so still there after the cut.
IN_FLIGHT_BYTES = 64 << 10


@pytest.fixture(scope="module")
def expected_long() -> list[int]:
    return colocated([LONG_PROMPT], MAX_TOKENS)[0]


# Each plane once, each failure policy on at least one (the policy acts after the plane has
# failed the load, the same way whichever plane did): 50 s less of CI than every pair. Push
# recomputes: blocks a cut-off producer half wrote must then not be read as its KV.
POLICY_BY_PLANE = {"rma": "fail", "tagged": "recompute", "push": "recompute"}


def test_a_partition_during_reads_fails_the_load_typed_and_the_decode_serves_on(
    tmp_path, data_plane, expected, expected_long
):
    """A prefill host cut off while the decode reads its KV: the load fails within seconds
    (``ProducerUnreachable``, or recomputed to the same tokens), the decode serves the next
    request once the link is back, and no KV block is left in use on either side."""
    policy = POLICY_BY_PLANE[data_plane]
    with network("rd", shaped=True) as net:
        hosts = {name: net.add_host(name) for name in ("prefill", "decode", "router", "client")}
        prefill_host, decode_host, client = hosts["prefill"], hosts["decode"], hosts["client"]
        pushed = data_plane == "push"
        extra = {**(PUSH_READ_EXTRA if pushed else READ_EXTRA), "data_plane": data_plane}
        processes: list[ServiceProcess] = []
        try:
            processes += start_together(
                lambda: start_daemon(prefill_host, "prefill", tmp_path, extra=extra),
                lambda: start_daemon(decode_host, "decode", tmp_path, extra=extra, policy=policy),
            )
            prefill, decode = processes
            # --no-kv-stream: the decode is called once the router has the prefill's answer, so
            # the cut interrupts the decode's read and nothing else. (With the KV streamed, a
            # prefill cut off before its answer reached the router holds the request until the
            # router's deadline, whatever the decode did: a router issue, not tested here.)
            router = start_router(hosts["router"], tmp_path, [prefill], [decode], "--no-kv-stream")
            processes.append(router)
            # Handshake made and UCX endpoints up (RMA keys fetched) by a first request (not a
            # prefix of the long prompt: nothing of it is cached on the decode).
            (warm,) = complete(client, router.address, [_body(1)])
            assert _tokens(warm) == expected[1]
            net.shape(prefill_host, READ_RATE)
            runner = run_requests(client, router.address, [_long_body()], timeout_s=120)
            try:
                reading = _wait_reading(net, client, decode, (prefill_host, prefill), decode_host)
                net.partition(prefill_host)
                cut_at = time.monotonic()
                # Nothing is acknowledged across a cut link: what is unacknowledged now was in
                # flight when it went down.
                stuck = _unacknowledged(net, (prefill_host, prefill), decode_host)
                # Answered while the prefill is still cut off: the decode gave up on its own.
                (result,) = results(runner, timeout_s=180)
            finally:
                net.heal(prefill_host)
                net.unshape(prefill_host)
            answered_after = result["started_at"] + result["elapsed_s"] - cut_at
            print(
                f"{data_plane}/{policy}: cut while {reading}, {stuck} B stuck; answered "
                f"{result['status']} {answered_after:.2f} s after the cut"
            )
            assert stuck > 0, f"no KV was in flight when the link went down ({reading})"
            assert answered_after < (PUSH_ANSWERED_WITHIN_S if pushed else ANSWERED_WITHIN_S), (
                result
            )
            if policy == "fail":
                assert result["status"] == 502, result
                message = result["body"]["error"]["message"]
                assert "KV load failed for request" in message, message
                assert "ProducerUnreachable" in message, message  # the probes, not the timeout
                assert f"{prefill_host.address}:" in message, message
            else:
                # The whole prompt recomputed on the decode (nothing it read is used), to the
                # same tokens.
                assert _tokens(result) == expected_long
                recomputed = result["body"]["kvtransfer"]["num_recomputed_tokens"]
                assert recomputed == result["body"]["usage"]["prompt_tokens"], result
                # Why, in the decode's log: the probes, not the timeout.
                why = [line for line in _log(decode) if result["body"]["id"] in line]
                assert any("failed: ProducerUnreachable" in line for line in why), why
            assert admin_transfers(client, decode.address) == []
            # The decode serves on: once the router takes the prefill back, the long prompt's
            # KV is read from it (new UCX endpoints) and the tokens equal colocated (nothing
            # the cut push wrote late corrupted the decode's cache).
            answer = _served_after_heal(client, router.address)
            assert _tokens(answer) == expected_long
            info = answer["body"]["kvtransfer"]
            assert info["kv_blocks_received"] > 0 and info["num_recomputed_tokens"] == 0, info
            counters = admin_status(client, decode.address)["counters"]
            assert counters["kv_loads_failed"] == 1, counters
            # No KV block left in use: the decode gave its blocks back when the load failed;
            # the prefill, told by nobody while cut off, at the latest when the lease ends.
            _wait_until_none_used(client, [prefill, decode], READ_EXTRA["kv_lease_s"] + 30)
            assert admin_transfers(client, prefill.address) == []
        finally:
            for process in reversed(processes):
                process.terminate()
    assert [exit_used_blocks(p) for p in processes[:2]] == [0, 0]


def _log(process: ServiceProcess) -> list[str]:
    return process.log_path.read_text(errors="replace").splitlines()


def _long_body() -> dict[str, Any]:
    return {"prompt": LONG_PROMPT, "max_tokens": MAX_TOKENS}


def _unacknowledged(net: Network, prefill: tuple[Host, ServiceProcess], decode_host: Host) -> int:
    """Bytes the prefill sent to the decode that the decode has not acknowledged, on its TCP
    sockets to the decode other than its servers' (KV handshake, gRPC, metrics): UCX's, which
    carry the KV, whichever side dialed them."""
    host, process = prefill
    services = _service_ports(process)
    return sum(
        c.send_q
        for c in net.connections(host)
        if c.peer_address == decode_host.address and c.local_port not in services
    )


def _wait_reading(
    net: Network,
    client: Host,
    decode: ServiceProcess,
    prefill: tuple[Host, ServiceProcess],
    decode_host: Host,
) -> str:
    """Until the decode lists its load under way ("recv") and the prefill's UCX sockets to it
    hold `IN_FLIGHT_BYTES` unacknowledged, checked again last (just before the caller cuts):
    the read is mid-transfer. What was seen, for the log."""

    def reading() -> str | None:
        # ss first (milliseconds), KVAdmin (a process start) only once KV is on its way.
        if _unacknowledged(net, prefill, decode_host) < IN_FLIGHT_BYTES:
            return None
        loads = [t for t in admin_transfers(client, decode.address) if t["direction"] == "recv"]
        queued = _unacknowledged(net, prefill, decode_host)
        if not loads or queued < IN_FLIGHT_BYTES:
            return None
        (load,) = loads
        return f"loading {load['num_blocks']} blocks for {load['age_s']:.2f} s, {queued} B queued"

    return wait_until(reading, "the decode reading the long prompt's KV", 60, interval=0.02)


def _served_after_heal(client: Host, url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The long prompt's first 200 answer. Until then, the only answer allowed is the router's
    503 for a prefill it ejected during the partition and has not checked healthy again."""
    last: list[Any] = [None]

    def served() -> dict[str, Any] | None:
        (answer,) = complete(client, url, [_long_body()])
        last[0] = answer
        if answer["status"] == 200:
            return answer
        assert answer["status"] == 503, answer
        assert answer["body"]["error"]["code"] == "no_healthy_daemon", answer
        return None

    return wait_until(served, lambda: f"served after the heal ({last[0]})", timeout_s, interval=0.5)
