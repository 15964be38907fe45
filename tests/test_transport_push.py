"""Push: a producer writes its KV one-sided into blocks a consumer granted it.

A consumer agent takes pushes (`start_server`'s ``push_grants``: its caches mapped a second
time, for remote writes) and grants a lease of its own blocks (`LeaseGrants.grant_push`); a
producer agent presenting that lease gets the write keys and writes (`KVTransferAgent.push`),
same host through ``process_vm_writev`` or, counted as another host, through UCX puts over TCP.
Both agents live in this process, each with its own UCX worker (the raw building blocks between
processes: tests/test_transport_put.py).

Bytes: the consumer's granted blocks must equal the producer's source blocks, every (layer,
block, K/V, head, token, dim), and every other block keep its sentinel. Guards: no keys or
writes without the grant, with another secret, with another request's lease, after the lease
ended (a replay); a revocation while writes run keeps the blocks out of use (`drained`) until
the producer says its writes stopped, and that push fails typed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transport_helpers.kv import LayerGroup, empty_caches, layer_tensor, make_caches
from transport_helpers.procs import ServerSpec, kv_servers

from kvtransfer.transport import (
    AccessDenied,
    ErrorCode,
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    LeaseNotGranted,
    PeerUnreachable,
    PullSpec,
    RemoteTransferError,
    TransferTimeoutError,
    TransportConfig,
    direct_read,
    new_secret,
    secret_digest,
    ucp_rma,
)
from kvtransfer.transport.access import LeaseEndedDuringRead

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 3)
SEED = 23
SENTINEL = -7.0
WAIT_S = 20.0
DEST = (7, 3, 9)
SOURCE = (1, 2, 5)


class Pushing:
    """A consumer agent taking pushes and a producer agent connected to it, in this process;
    with ``network`` the producer counts as another host (UCX puts over TCP)."""

    def __init__(self, network: bool) -> None:
        self.network = network
        self.grants = LeaseGrants(grant_wait_s=1.0)
        self.local = empty_caches([GROUP])
        self.consumer = KVTransferAgent(TransportConfig(timeout_s=WAIT_S))
        self.consumer.register_kv_caches(self.local)
        self.consumer.start_server(push_grants=self.grants)
        self.source = make_caches(SEED, [GROUP])
        self.producer = KVTransferAgent(
            TransportConfig(timeout_s=WAIT_S, shared_memory=not network)
        )
        self.producer.register_kv_caches(self.source)
        self.peer = self.producer.connect(self.consumer.address, layouts=self.consumer.kv_layouts())

    def grant(self, lease_id: str, blocks=DEST, prompt: str = "p") -> LeaseAccess:
        secret = new_secret()
        self.grants.grant_push(lease_id, secret_digest(secret), blocks, GROUP.names(), prompt)
        return LeaseAccess(lease_id, secret, prompt, 0, tuple(blocks))

    def push(self, name: str, lease: LeaseAccess | None, remote=DEST, local=SOURCE, **kwargs):
        spec = PullSpec(name, GROUP.names(), remote, local, lease=lease)
        return self.producer.push(self.peer, spec, **kwargs)

    def untouched(self) -> bool:
        return all((cache == SENTINEL).all() for cache in self.local.values())

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


@pytest.fixture(params=["direct", "network"])
def pushing(request):
    setup = Pushing(network=request.param == "network")
    yield setup
    setup.close()


def _written(setup: Pushing, pairs) -> None:
    for name in GROUP.names():
        expected = torch.full_like(setup.local[name], SENTINEL)
        for remote, local in pairs:
            expected[remote] = setup.source[name][local]
        assert torch.equal(setup.local[name], expected), name


def test_a_push_writes_the_granted_blocks_and_lands(pushing):
    lease = pushing.grant("req-1")
    assert not pushing.grants.landed("req-1")
    result = pushing.push("req-1", lease).result(WAIT_S)
    # The producer tells the landing without waiting for the answer: the consumer waits.
    assert pushing.grants.wait_landed("req-1", WAIT_S)
    assert (
        result.one_sided
        and result.payload_bytes == 3 * 3 * pushing.local[GROUP.names()[0]][0].numel() * 4
    )
    _written(pushing, list(zip(DEST, SOURCE, strict=True)))
    counters = pushing.producer.one_sided_counters
    if pushing.network:
        assert (counters.ucx_writes, counters.direct_writes) == (1, 0) and counters.ucx_puts
    else:
        assert (counters.direct_writes, counters.ucx_writes) == (1, 0)
    assert counters.direct_reads == counters.ucx_reads == 0  # rows only: counted apart
    # The lease's blocks can go back once it ends: no write of it runs.
    pushing.grants.revoke_nowait(["req-1"])
    assert pushing.grants.drained(["req-1"]) == {"req-1"}


def _eventually(condition, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _refusal(handle) -> AccessDenied | RemoteTransferError:
    with pytest.raises((AccessDenied, RemoteTransferError)) as refused:
        handle.result(WAIT_S)
    return refused.value


def test_no_write_without_the_grant_its_secret_its_blocks_or_after_it_ended(pushing):
    held = pushing.grant("held")
    other = pushing.grant("other", blocks=(11, 12, 13), prompt="q")
    attempts = [
        # Never granted (waited for within the deadline, then refused as not granted).
        (LeaseAccess("nobody", new_secret(), "p", 0, DEST), DEST, ErrorCode.LEASE_NOT_GRANTED),
        (LeaseAccess("held", new_secret(), "p", 0, DEST), DEST, ErrorCode.ACCESS_DENIED),
        # Another request's lease, its secret too, but blocks and prompt of this one.
        (LeaseAccess("other", other.secret, "p", 0, DEST), DEST, ErrorCode.ACCESS_DENIED),
    ]
    for lease, blocks, code in attempts:
        error = _refusal(pushing.push("x", lease, remote=blocks, timeout_s=2.0))
        assert isinstance(error, RemoteTransferError) and error.code == code, error
    assert pushing.untouched()
    # Blocks other than the grant's, with its own secret: refused before any write.
    error = _refusal(pushing.push("x", held, remote=(7, 3, 10)))
    assert "reordered, repeated, shifted or outside it" in str(error)
    assert pushing.untouched()
    pushing.push("held", held).result(WAIT_S)
    _written(pushing, list(zip(DEST, SOURCE, strict=True)))
    # A replay after the lease ended: refused, nothing written (the source changed since).
    pushing.grants.revoke_nowait(["held"])
    for cache in pushing.source.values():
        cache.fill_(3.0)
    error = _refusal(pushing.push("held", held))
    assert isinstance(error, RemoteTransferError) and error.code == ErrorCode.ACCESS_DENIED
    assert "lease 'held' has ended" in str(error)
    assert not any((cache == 3.0).any() for cache in pushing.local.values())


def test_a_revoke_during_writes_keeps_the_blocks_until_the_writes_stopped(pushing, monkeypatch):
    lease = pushing.grant("slow")
    writing, release = threading.Event(), threading.Event()
    if pushing.network:
        original = ucp_rma.Puts.post_many

        def held(self, *args, **kwargs):
            writing.set()
            assert release.wait(WAIT_S)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(ucp_rma.Puts, "post_many", held)
    else:
        original = direct_read.DirectWriter.run

        def held(self, plan):
            writing.set()
            assert release.wait(WAIT_S)
            return original(self, plan)

        monkeypatch.setattr(direct_read.DirectWriter, "run", held)
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        outcome["error"] = pushing.push("slow", lease).exception(WAIT_S)

    thread = threading.Thread(target=run)
    thread.start()
    assert writing.wait(WAIT_S)
    pushing.grants.revoke_nowait(["slow"])
    # A write may still land: the blocks stay out of use.
    assert pushing.grants.drained(["slow"]) == set()
    release.set()
    thread.join(WAIT_S)
    assert isinstance(outcome["error"], LeaseEndedDuringRead)
    assert "ended while push 'slow' wrote its blocks" in str(outcome["error"])
    # The producer told the consumer its writes stopped: now they may be reused.
    assert _eventually(lambda: pushing.grants.drained(["slow"]) == {"slow"})
    with pytest.raises(AccessDenied, match="push lease 'slow' has ended"):
        pushing.grants.landed("slow")


@pytest.mark.parametrize("network", [False, True], ids=["direct", "network"])
def test_two_producer_ranks_each_write_their_heads_and_the_push_lands_after_both(network):
    """A TP 2 producer into a TP 1 consumer: each producer worker writes its 2 of the 4 heads
    into the same granted blocks; the lease lands only once both reported their layers."""
    grants = LeaseGrants(grant_wait_s=1.0)
    local = empty_caches([GROUP])
    whole = {name: layer_tensor(SEED, name, num_heads=4) for name in GROUP.names()}
    agents = []
    try:
        consumer = KVTransferAgent(TransportConfig(timeout_s=WAIT_S))
        agents.append(consumer)
        consumer.register_kv_caches(local)
        consumer.start_server(push_grants=grants)
        secret = new_secret()
        grants.grant_push("tp", secret_digest(secret), DEST, GROUP.names(), "p", writers=2)
        lease = LeaseAccess("tp", secret, "p", 0, DEST)
        for rank in range(2):
            heads = range(2 * rank, 2 * rank + 2)
            producer = KVTransferAgent(TransportConfig(timeout_s=WAIT_S, shared_memory=not network))
            agents.append(producer)
            producer.register_kv_caches(
                {n: t[:, :, heads.start : heads.stop].contiguous() for n, t in whole.items()}
            )
            peer = producer.connect(consumer.address, layouts=consumer.kv_layouts())
            spec = PullSpec(
                f"tp-{rank}", GROUP.names(), DEST, SOURCE, heads, range(0, 2), lease=lease
            )
            producer.push(peer, spec).result(WAIT_S)
            if rank == 0:
                assert not grants.wait_landed("tp", 0.2)  # the other rank's heads are due
        assert grants.wait_landed("tp", WAIT_S)
        for name in GROUP.names():
            expected = torch.full_like(local[name], SENTINEL)
            for remote, source in zip(DEST, SOURCE, strict=True):
                expected[remote] = whole[name][source]
            assert torch.equal(local[name], expected), name
    finally:
        for agent in reversed(agents):
            agent.close()


@pytest.mark.parametrize("network", [False, True], ids=["direct", "network"])
def test_a_consumer_that_dies_mid_push_fails_the_push_typed(network, monkeypatch):
    """The consumer process is killed while the producer writes: the push ends with
    `PeerUnreachable` (its process gone, or its connection reset) within the push's own
    deadline, never a hang, and the producer's agent keeps working."""
    secret = new_secret()
    spec = ServerSpec(SEED, (GROUP,), push_lease=f"dying:{secret}:7,3,9")
    writing, release = threading.Event(), threading.Event()
    target = ucp_rma.Puts if network else direct_read.DirectWriter
    name = "post_many" if network else "run"
    original = getattr(target, name)

    def held(self, *args, **kwargs):
        writing.set()
        assert release.wait(WAIT_S)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(target, name, held)
    with kv_servers([spec]) as (server,):
        producer = KVTransferAgent(TransportConfig(timeout_s=10.0, shared_memory=not network))
        try:
            producer.register_kv_caches(make_caches(SEED + 1, [GROUP]))
            peer = producer.connect(server.address, layouts=server.layouts)
            lease = LeaseAccess("dying", secret, "", 0, DEST)
            outcome: dict[str, BaseException | None] = {}

            def run() -> None:
                handle = producer.push(
                    peer, PullSpec("dying", GROUP.names(), DEST, SOURCE, lease=lease)
                )
                outcome["error"] = handle.exception(WAIT_S)

            thread = threading.Thread(target=run)
            thread.start()
            assert writing.wait(WAIT_S)
            server.kill()
            release.set()
            thread.join(WAIT_S)
            assert not thread.is_alive()
            assert isinstance(outcome["error"], PeerUnreachable | TransferTimeoutError), outcome
            assert not producer.closed
        finally:
            producer.close()


def test_an_agent_taking_pushes_serves_no_unauthenticated_reads(pushing):
    """Taking pushes starts a server; without read grants of its own it must refuse reads
    (tagged and one-sided keys), not serve its caches to any peer."""
    spec = PullSpec("steal", GROUP.names(), DEST, SOURCE)
    before = {name: cache.clone() for name, cache in pushing.source.items()}
    for one_sided in (False, True):
        peer = pushing.producer.connect(
            pushing.consumer.address, layouts=pushing.consumer.kv_layouts(), one_sided=one_sided
        )
        error = _refusal(pushing.producer.pull(peer, spec))
        assert "presents no lease" in str(error), error
    assert all(torch.equal(pushing.source[name], cache) for name, cache in before.items())
    assert pushing.consumer.server.keys_served == 0


def test_a_session_writes_layer_by_layer_after_one_begin_and_lands_at_finish(pushing):
    """What a prefill pushing each layer as it computes it does: one begin, a write per
    layer, one landed notice. The consumer's load is not complete before the finish, even
    with every layer written (the writer is still counted)."""
    # The write keys are fetched once per consumer: fetch them with a first push.
    pushing.push("warm", pushing.grant("warm")).result(WAIT_S)
    assert pushing.grants.wait_landed("warm", WAIT_S)
    server = pushing.consumer.server
    before = server.messages_received
    lease = pushing.grant("req-layers")
    with pushing.producer.begin_push(pushing.peer, lease) as session:
        for layer in GROUP.names():
            spec = PullSpec(f"req-layers/{layer}", (layer,), DEST, SOURCE, lease=lease)
            session.write(spec).result(WAIT_S)
            assert not pushing.grants.landed("req-layers")
        assert session.written == set(GROUP.names())
    assert pushing.grants.wait_landed("req-layers", WAIT_S)
    _written(pushing, list(zip(DEST, SOURCE, strict=True)))
    # Three layers, two notices: begin and landed (the producer's messages this session).
    assert _eventually(lambda: server.messages_received - before == 2)


def test_a_session_after_a_failed_write_writes_nothing_more_and_ends_stopped(pushing):
    lease = pushing.grant("req-fail")
    session = pushing.producer.begin_push(pushing.peer, lease)
    first, second = GROUP.names()[:2]
    session.write(PullSpec("w1", (first,), DEST, SOURCE, lease=lease)).result(WAIT_S)
    pushing.grants.revoke_nowait(["req-fail"])
    # The lease ended: the next write's row check finds no row (a row may lag its grant, so
    # it is waited for within the write's timeout) and writes nothing.
    failed = session.write(PullSpec("w2", (second,), DEST, SOURCE, lease=lease), timeout_s=1.0)
    with pytest.raises((LeaseNotGranted, TransferTimeoutError), match="'req-fail'"):
        failed.result(WAIT_S)
    again = session.write(PullSpec("w3", (second,), DEST, SOURCE, lease=lease))
    assert again.exception() is failed.exception()
    assert not any((pushing.local[second][b] != SENTINEL).any() for b in DEST)
    # The blocks stay out of use until the producer says its writes stopped.
    assert pushing.grants.drained(["req-fail"]) == set()
    session.finish()
    assert _eventually(lambda: pushing.grants.drained(["req-fail"]) == {"req-fail"})
    with pytest.raises(ValueError, match="is finished"):
        session.write(PullSpec("w4", (second,), DEST, SOURCE, lease=lease))


def test_a_session_writes_only_its_own_lease(pushing):
    pushing.push("warm", pushing.grant("warm")).result(WAIT_S)
    assert pushing.grants.wait_landed("warm", WAIT_S)
    server = pushing.consumer.server
    before = server.messages_received
    lease = pushing.grant("req-own")
    other = pushing.grant("req-other", blocks=(0, 1, 2))
    with (
        pushing.producer.begin_push(pushing.peer, lease) as session,
        pytest.raises(ValueError, match="its own push lease"),
    ):
        session.write(PullSpec("x", GROUP.names(), (0, 1, 2), SOURCE, lease=other))
    # Begun and ended (landed, with no layer): nothing written, nothing landed.
    assert _eventually(lambda: server.messages_received - before == 2)
    assert not pushing.grants.landed("req-own") and not pushing.grants.landed("req-other")
    assert all((cache[[0, 1, 2]] == SENTINEL).all() for cache in pushing.local.values())


def test_a_session_left_by_an_exception_ends_stopped(pushing):
    lease = pushing.grant("req-raise")
    with (
        pytest.raises(RuntimeError, match="the engine failed"),
        pushing.producer.begin_push(pushing.peer, lease) as session,
    ):
        session.write(PullSpec("r1", GROUP.names()[:1], DEST, SOURCE, lease=lease))
        raise RuntimeError("the engine failed mid-prefill")
    assert isinstance(session.failed, RuntimeError) and session.finished
    assert not pushing.grants.landed("req-raise")
    # The stop reached the consumer: once it ends the lease, the blocks can go back.
    pushing.grants.revoke_nowait(["req-raise"])
    assert _eventually(lambda: pushing.grants.drained(["req-raise"]) == {"req-raise"})
