"""RMA mode of the data plane: one-sided reads of a producer's registered KV, and what guards
them.

Bytes: a producer process serves seeded caches stored in one axis order, the test pulls into
caches stored in another, with head slices and scattered blocks, and every (layer, block, K/V,
head, token, dim) is compared with the seeded values (torch indexing, independent of the runs
the reader computed); untouched blocks keep their sentinel.

Guards (a producer agent with `LeaseGrants` in this process, over real UCX): keys only for a
valid lease; a read waits for its lease row; a lease that ends while a read runs fails that
read; the prompt and the block list are checked one-sided; and, stated plainly, a peer holding
keys can read any registered block (the test shows it with raw gets).
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import torch
from transport_helpers.kv import LayerGroup, empty_caches, in_order, layer_tensor, make_caches
from transport_helpers.procs import ServerSpec, freeze, kv_servers

from kvtransfer.transport import (
    AccessDenied,
    ErrorCode,
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PeerUnreachable,
    PullSpec,
    RemoteTransferError,
    TransportConfig,
    new_secret,
    secret_digest,
)
from kvtransfer.transport import rma as rma_module
from kvtransfer.transport.access import LeaseEndedDuringRead
from kvtransfer.transport.ucp_rma import Gets, unpack_key

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 3)
SEED = 11
SENTINEL = -7.0
WAIT_S = 20.0


def _local(order: str, heads: int = 4) -> dict[str, torch.Tensor]:
    return {
        name: in_order(cache, order)
        for name, cache in empty_caches([GROUP], num_heads=heads).items()
    }


@pytest.fixture(scope="module")
def producers():
    """One producer process per physical order (and a tagged-only one), started together."""
    specs = {
        "B2HND": ServerSpec(SEED, (GROUP,)),
        "BH2ND": ServerSpec(SEED, (GROUP,), order="BH2ND"),
        "B2NHD": ServerSpec(SEED, (GROUP,), order="B2NHD"),
        "tagged": ServerSpec(SEED, (GROUP,), data_plane="tagged"),
    }
    with kv_servers(list(specs.values())) as servers:
        yield dict(zip(specs, servers, strict=True))


# (remote heads, local heads, local head count): whole blocks, a TP 2 consumer's half, a
# TP 2 producer's half into a TP 1 consumer, one head.
HEADS = [
    (None, None, 4),
    (range(2, 4), None, 2),
    (range(0, 2), range(2, 4), 4),
    (range(3, 4), range(1, 2), 4),
]
REMOTE_IDS = (5, 6, 7, 40, 2, 63)
LOCAL_IDS = (0, 1, 2, 9, 30, 31)


@pytest.mark.parametrize("path", ["direct", "ucx"])
@pytest.mark.parametrize("remote_order", ["B2HND", "BH2ND", "B2NHD"])
@pytest.mark.parametrize("local_order", ["B2HND", "2BHND", "BNH2D"])
@pytest.mark.parametrize("heads", HEADS, ids=["all", "tp2-half", "into-half", "one-head"])
def test_one_sided_pull_lands_every_byte(producers, remote_order, local_order, heads, path):
    """Every byte lands, on both paths a same-host consumer may take: ``process_vm_readv``
    (direct) and UCX gets (``shared_memory=False``: the producer counts as another host, its
    UCX worker serves the gets). One-sided means: the consumer's counters say that path moved
    exactly the payload, and the producer's code handled no message for the read (on the
    direct path it is even frozen while it is read)."""
    remote_heads, local_heads, num_heads = heads
    server = producers[remote_order]
    local = _local(local_order, num_heads)
    config = TransportConfig(timeout_s=WAIT_S, shared_memory=path == "direct")
    with KVTransferAgent(config) as agent:
        agent.register_kv_caches(local)
        peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
        # The first pull fetches the producer's keys (one message to its code); then the
        # caches start over.
        keys = PullSpec("keys", GROUP.names(), (1,), (1,), remote_heads, local_heads)
        agent.pull(peer, keys).result(WAIT_S)
        for cache in local.values():
            cache.fill_(SENTINEL)
        before, moved_before = server.counters(), agent.one_sided_counters
        spec = PullSpec("bytes", GROUP.names(), REMOTE_IDS, LOCAL_IDS, remote_heads, local_heads)
        if path == "direct":
            freeze(server.process.pid)
        try:
            result = agent.pull(peer, spec).result(WAIT_S)
        finally:
            server.process.send_signal(signal.SIGCONT)
        moved = agent.one_sided_counters
        assert (agent._rma_peers[peer.ucx_address].direct is None) == (path == "ucx")
    assert server.counters() == before
    width = len(remote_heads or range(4))
    assert result.one_sided
    assert result.payload_bytes == len(GROUP.names()) * len(LOCAL_IDS) * 2 * width * 16 * 8 * 4
    direct_bytes = moved.direct_bytes - moved_before.direct_bytes
    ucx_bytes = moved.ucx_bytes - moved_before.ucx_bytes
    if path == "direct":
        assert (direct_bytes, ucx_bytes) == (result.payload_bytes, 0)
        assert moved.direct_reads - moved_before.direct_reads == 1
    else:
        assert (direct_bytes, ucx_bytes) == (0, result.payload_bytes)
        # One get per planned run.
        assert moved.ucx_gets - moved_before.ucx_gets == result.num_messages
    r_heads = remote_heads or range(4)
    l_heads = local_heads or range(num_heads)
    for name in GROUP.names():
        seeded = layer_tensor(SEED, name)
        cache = local[name]
        for remote_id, local_id in zip(REMOTE_IDS, LOCAL_IDS, strict=True):
            got = cache[local_id, :, l_heads.start : l_heads.stop]
            want = seeded[remote_id, :, r_heads.start : r_heads.stop]
            assert torch.equal(got, want), (name, remote_id, local_id)
        untouched = torch.ones(cache.shape[0], dtype=torch.bool)
        untouched[list(LOCAL_IDS)] = False
        assert (cache[untouched] == SENTINEL).all(), name
        if len(l_heads) < num_heads:
            others = [h for h in range(num_heads) if h not in l_heads]
            assert (cache[list(LOCAL_IDS)][:, :, others] == SENTINEL).all(), name


def test_contiguous_blocks_and_layers_are_one_read_each(producers):
    """Runs merge across blocks (and across layers when the layers are adjacent in memory):
    the run count is what the layouts allow, exactly."""
    server = producers["B2HND"]
    local = empty_caches([GROUP])
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as agent:
        agent.register_kv_caches(local)
        peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
        names = GROUP.names()
        whole = agent.pull(peer, PullSpec("run", names, range(8, 16), range(0, 8))).result(WAIT_S)
        # One run per layer: 8 consecutive blocks on both sides, each layer its own tensor.
        assert whole.num_messages == len(names)
        half = agent.pull(
            peer, PullSpec("half", names, range(8, 16), range(0, 8), range(0, 2), range(0, 2))
        ).result(WAIT_S)
        # Two heads of four: one run per (layer, block, K/V).
        assert half.num_messages == len(names) * 8 * 2
    for name in names:
        assert torch.equal(local[name][0:8], layer_tensor(SEED, name)[8:16])


def test_layers_in_one_buffer_are_read_as_one_run():
    """vLLM keeps every layer in one buffer: adjacent layers' blocks merge into one read."""
    shape = (len(GROUP.names()), 16, 2, 4, 16, 8)
    source = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape)
    target = torch.full(shape, SENTINEL)
    names = GROUP.names()
    with (
        KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as producer,
        KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as consumer,
    ):
        producer.register_kv_caches({n: source[i] for i, n in enumerate(names)})
        producer.start_server()
        consumer.register_kv_caches({n: target[i] for i, n in enumerate(names)})
        peer = consumer.connect(producer.address, layouts=producer.kv_layouts(), one_sided=True)
        result = consumer.pull(peer, PullSpec("all", names, range(16), range(16))).result(WAIT_S)
    assert result.num_messages == 1
    assert torch.equal(target, source)


def test_a_tagged_only_producer_is_read_two_sided(producers):
    server = producers["tagged"]
    local = empty_caches([GROUP])
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as agent:
        agent.register_kv_caches(local)
        peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
        result = agent.pull(peer, PullSpec("t", GROUP.names(), (3, 4), (0, 1))).result(WAIT_S)
        # One tagged message, not one read per run: the producer refused to hand keys.
        assert result.num_messages == 1
    for name in GROUP.names():
        assert torch.equal(local[name][0:2], layer_tensor(SEED, name)[3:5])


# A dead producer must fail a read with `PeerUnreachable` well before the read's deadline
# (`WAIT_S`): the read finds it (no such process; the TCP lane reset) or, failing that, the
# liveness probe that runs every `_WAIT_HOOK_S` would. Eight probe periods is generous.
DEATH_FOUND_S = 8 * rma_module._WAIT_HOOK_S


@pytest.mark.parametrize("network", [False, True], ids=["direct", "network"])
def test_a_dead_producer_fails_the_read_with_a_typed_error(network):
    assert DEATH_FOUND_S < WAIT_S / 4
    with kv_servers([ServerSpec(SEED, (GROUP,))]) as (server,):
        local = empty_caches([GROUP])
        config = TransportConfig(timeout_s=WAIT_S, shared_memory=not network)
        with KVTransferAgent(config) as agent:
            agent.register_kv_caches(local)
            peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
            agent.pull(peer, PullSpec("alive", GROUP.names(), (1,), (1,))).result(WAIT_S)
            assert (agent._rma_peers[peer.ucx_address].direct is None) == network
            server.kill()
            started = time.monotonic()
            handle = agent.pull(peer, PullSpec("dead", GROUP.names(), (2, 3), (2, 3)))
            with pytest.raises(PeerUnreachable):
                handle.result(WAIT_S)
            assert time.monotonic() - started < DEATH_FOUND_S
            # The agent still works (its endpoint to the dead peer was reset).
            assert not agent.closed


def test_a_producer_killed_mid_read_fails_it_typed():
    """Over the network the producer's UCX worker serves the gets: frozen, it serves none, so
    the read is certainly in flight when the hook (the daemon's liveness probe) runs; the
    producer is killed there, and the read ends in `PeerUnreachable` soon after, not at its
    deadline, nor in a hang or an abort."""
    with kv_servers([ServerSpec(SEED, (GROUP,))]) as (server,):
        config = TransportConfig(timeout_s=WAIT_S, shared_memory=False)
        with KVTransferAgent(config) as agent:
            agent.register_kv_caches(empty_caches([GROUP]))
            peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
            agent.pull(peer, PullSpec("warm", GROUP.names(), (1,), (1,))).result(WAIT_S)
            assert agent._rma_peers[peer.ucx_address].direct is None  # the network path
            freeze(server.process.pid)
            killed: list[float] = []

            def probe() -> None:
                if not killed:
                    server.kill()
                    killed.append(time.monotonic())

            try:
                handle = agent.pull(
                    peer, PullSpec("mid", GROUP.names(), range(64), range(64)), on_wait=probe
                )
                with pytest.raises(PeerUnreachable):
                    handle.result(WAIT_S)
            finally:
                if server.process.poll() is None:
                    server.kill()
            assert killed, "the read never waited: it was not in flight"
            assert time.monotonic() - killed[0] < DEATH_FOUND_S
            # The agent still serves (its endpoint to the dead peer was reset).
            assert not agent.closed


# --------------------------------------------------------------------------- leased producer


class Leased:
    """A producer agent serving leased KV and a consumer agent, in this process; with
    ``network`` the consumer counts as another host (UCX gets over TCP, served by the
    producer's UCX worker), else it reads the producer's memory directly."""

    def __init__(self, network: bool = False, grant_wait_s: float = 1.0) -> None:
        self.grants = LeaseGrants(grant_wait_s=grant_wait_s)
        self.source = make_caches(SEED, [GROUP])
        self.producer = KVTransferAgent(
            TransportConfig(timeout_s=WAIT_S, grant_wait_s=grant_wait_s)
        )
        self.producer.register_kv_caches(self.source)
        self.producer.start_server(self.grants)
        self.local = empty_caches([GROUP])
        self.consumer = KVTransferAgent(
            TransportConfig(timeout_s=WAIT_S, grant_wait_s=grant_wait_s, shared_memory=not network)
        )
        self.consumer.register_kv_caches(self.local)
        self.peer = self.consumer.connect(
            self.producer.address, layouts=self.producer.kv_layouts(), one_sided=True
        )

    def grant(self, lease_id: str, blocks: tuple[int, ...], prompt: str = "") -> LeaseAccess:
        secret = new_secret()
        self.grants.grant(lease_id, secret_digest(secret), blocks, prompt)
        return LeaseAccess(lease_id, secret, prompt, 0, blocks)

    def pull(self, name: str, remote, local, lease, layers=None, **kwargs):
        spec = PullSpec(name, layers or GROUP.names(), remote, local, lease=lease)
        return self.consumer.pull(self.peer, spec, **kwargs)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


@pytest.fixture(params=["direct", "network"])
def leased(request):
    setup = Leased(network=request.param == "network")
    yield setup
    rma = setup.consumer._rma_peers.get(setup.peer.ucx_address)
    if rma is not None:
        # The path the test meant to exercise is the one that ran.
        assert (rma.direct is None) == (request.param == "network")
    setup.close()


def _refused(handle) -> AccessDenied | RemoteTransferError:
    with pytest.raises((AccessDenied, RemoteTransferError)) as refused:
        handle.result(WAIT_S)
    return refused.value


def test_keys_only_for_a_valid_lease(leased):
    held = leased.grant("held", (4, 5))
    denied, not_granted = ErrorCode.ACCESS_DENIED, ErrorCode.LEASE_NOT_GRANTED
    attempts = [
        (None, "presents no lease", denied),
        (LeaseAccess("nobody", new_secret()), "'nobody' is unknown", not_granted),
        (LeaseAccess("held", new_secret()), "wrong secret for lease 'held'", denied),
    ]
    for lease, reason, code in attempts:
        error = _refused(leased.pull("keys", (4, 5), (0, 1), lease))
        assert isinstance(error, RemoteTransferError) and error.code == code
        assert reason in str(error)
    assert all((cache == SENTINEL).all() for cache in leased.local.values())
    assert leased.producer.server.keys_served == 0
    leased.pull("good", (4, 5), (0, 1), held).result(WAIT_S)
    assert leased.producer.server.keys_served == 1
    for name in GROUP.names():
        assert torch.equal(leased.local[name][0:2], leased.source[name][4:6])


def test_a_read_waits_for_its_lease_row(leased):
    """The grant reaches the producer's table after the read began: the read waits for it
    (its liveness hook runs meanwhile) instead of failing or reading early."""
    leased.pull("keys", (1,), (1,), leased.grant("first", (1,))).result(WAIT_S)
    secret = new_secret()
    lease = LeaseAccess("late", secret, "", 0, (7, 8))
    waits: list[int] = []

    def on_wait() -> None:
        waits.append(len(leased.producer.lease_table))
        if len(waits) == 1:
            leased.grants.grant("late", secret_digest(secret), (7, 8))

    leased.pull("late", (7, 8), (2, 3), lease, on_wait=on_wait).result(WAIT_S)
    # The first wait saw only the first lease in the table: the read had started before.
    assert waits[0] == 1
    for name in GROUP.names():
        assert torch.equal(leased.local[name][2:4], leased.source[name][7:9])


@pytest.mark.parametrize("network", [False, True], ids=["direct", "network"])
@pytest.mark.parametrize("needed", [1, 2, 3])
def test_a_streamed_lease_is_read_once_its_layers_are_published(network, needed):
    """kv_stream: a lease is granted while its prefill computes, and the producer publishes
    its layers one at a time (the row's complete-layer count). A read of layers [0, k) waits
    for exactly k: the liveness hook of the waiting read publishes one layer per call, writing
    that layer's KV first (its blocks held stale values until then), and the read returns
    with k published, not fewer (it would hold stale KV) nor more (it waited too long), with
    the computed bytes of its layers and nothing of the others."""
    # A grant wait longer than publishing every layer at one per hook period takes.
    setup = Leased(network=network, grant_wait_s=WAIT_S)
    try:
        names = GROUP.names()
        blocks = (12, 13)
        setup.pull("keys", (1,), (1,), setup.grant("keys", (1,))).result(WAIT_S)
        for cache in setup.local.values():
            cache.fill_(SENTINEL)
        computed = {name: setup.source[name][list(blocks)].clone() for name in names}
        for name in names:
            setup.source[name][list(blocks)] = 99.0  # stale: what a reused block held
        secret = new_secret()
        setup.grants.grant("streamed", secret_digest(secret), blocks, pending_layers=names)
        lease = LeaseAccess("streamed", secret, "", 0, blocks)
        published: list[str] = []

        def publish_next() -> None:
            if len(published) < len(names):
                name = names[len(published)]
                setup.source[name][list(blocks)] = computed[name]
                setup.grants.layer_ready(["streamed"], name)
                published.append(name)

        handle = setup.pull("streamed", blocks, (4, 5), lease, names[:needed], on_wait=publish_next)
        handle.result(WAIT_S)
        assert len(published) == needed
        for name in names[:needed]:
            assert torch.equal(setup.local[name][4:6], computed[name]), name
        for name in names[needed:]:
            assert (setup.local[name] == SENTINEL).all(), name
        rma = setup.consumer._rma_peers[setup.peer.ucx_address]
        assert (rma.direct is None) == network
    finally:
        setup.close()


def test_a_lease_ended_during_the_read_fails_it(leased, monkeypatch):
    """The producer ends the lease and reuses its blocks after the data reads and before the
    check that follows them (a slow reader): the read fails, never passes as that KV."""
    lease = leased.grant("slow", (10, 11))
    leased.pull("keys", (10,), (0,), lease).result(WAIT_S)
    original = rma_module._LeaseRow.held

    def released_meanwhile(self, *args):
        leased.grants.revoke(["slow"])
        for cache in leased.source.values():
            cache[10:12] = 123.0  # another request's KV
        return original(self, *args)

    monkeypatch.setattr(rma_module._LeaseRow, "held", released_meanwhile)
    error = _refused(leased.pull("slow", (10, 11), (4, 5), lease))
    assert isinstance(error, LeaseEndedDuringRead)
    assert "ended while pull 'slow' read its blocks one-sided" in str(error)


def test_prompt_and_block_list_are_checked_one_sided(leased):
    lease = leased.grant("own", (20, 21, 22), prompt="digest-of-my-prompt")
    leased.pull("keys", (20,), (0,), lease).result(WAIT_S)
    other_prompt = LeaseAccess("own", lease.secret, "digest-of-another", 0, (20, 21, 22))
    error = _refused(leased.pull("prompt", (20, 21, 22), (1, 2, 3), other_prompt))
    assert "holds the KV of another prompt" in str(error)
    # The pull's blocks are not the lease's at those positions: refused before any read.
    error = _refused(leased.pull("order", (22, 21, 20), (1, 2, 3), lease))
    assert "reordered, repeated, shifted or outside it" in str(error)
    # A forged block list, consistent with itself: the producer's row disagrees.
    forged = LeaseAccess("own", lease.secret, "digest-of-my-prompt", 0, (22, 21, 20))
    error = _refused(leased.pull("forged", (22, 21, 20), (1, 2, 3), forged))
    assert "block list mismatch" in str(error)
    assert all((cache[1:4] == SENTINEL).all() for cache in leased.local.values())


def test_keys_let_their_holder_read_any_registered_block(leased):
    """What RMA mode does not protect, shown: a peer that authenticated once with its own
    lease can read every registered block with raw gets (the producer never sees the read)."""
    own = leased.grant("own", (1,))
    leased.pull("keys", (1,), (0,), own).result(WAIT_S)
    rma = leased.consumer._rma_peers[leased.peer.ucx_address]
    victim = leased.source[GROUP.names()[0]][50]  # a block no lease of this peer covers
    layer = rma.keys.layers[GROUP.names()[0]]
    stolen = torch.zeros_like(victim)
    loop = leased.consumer._loop
    endpoint = loop.endpoint_handle(leased.peer.ucx_address)
    rkey = unpack_key(endpoint, rma.keys.regions[layer.region].key)
    try:
        gets = Gets(loop.worker_handle, endpoint)
        gets.post_many(
            [stolen.data_ptr()],
            [stolen.numel() * 4],
            [layer.address + 50 * layer.strides[0]],
            [rkey],
        )
        gets.flush()
        deadline = time.monotonic() + WAIT_S
        while not gets.poll():
            assert time.monotonic() < deadline
    finally:
        from kvtransfer.transport.ucp_rma import destroy_key

        destroy_key(rkey)
    assert torch.equal(stolen, victim)


def test_caches_registered_after_serving_one_sided_are_refused():
    """Peers hold keys to the memory mapped when serving started: later layers are refused
    instead of being served from addresses nobody mapped."""
    with KVTransferAgent(TransportConfig()) as producer:
        producer.register_kv_caches(make_caches(SEED, [GROUP]))
        producer.start_server()
        more = make_caches(SEED, [LayerGroup("model.layers", 3, 1)])
        with pytest.raises(ValueError, match="must be registered before start_server in RMA"):
            producer.register_kv_caches(more)
        assert list(producer.kv_caches) == GROUP.names()


def test_a_same_host_read_not_allowed_directly_goes_through_ucx(producers, monkeypatch):
    """Where this process may not read the producer's memory itself (another user, a ptrace
    policy), the read falls back to UCX gets on the same host, without UCX's cma (left out:
    it aborts on a dead peer), and lands the same bytes."""

    refusals: list[int] = []

    def refused(self, plan):
        refusals.append(self.pid)
        raise rma_module.DirectReadUnavailable(f"not allowed to read process {self.pid}")

    monkeypatch.setattr(rma_module.DirectReader, "run", refused)
    server = producers["B2HND"]
    local = _local("B2HND")
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as agent:
        agent.register_kv_caches(local)
        peer = agent.connect(server.address, layouts=server.layouts, one_sided=True)
        spec = PullSpec("fallback", GROUP.names(), REMOTE_IDS, LOCAL_IDS)
        result = agent.pull(peer, spec).result(WAIT_S)
        rma = agent._rma_peers[peer.ucx_address]
        assert rma.direct is None  # it tried, was refused, and stopped trying
    assert refusals == [server.process.pid]
    assert result.one_sided
    for name in GROUP.names():
        seeded = layer_tensor(SEED, name)
        for remote_id, local_id in zip(REMOTE_IDS, LOCAL_IDS, strict=True):
            assert torch.equal(local[name][local_id], seeded[remote_id]), (name, remote_id)
