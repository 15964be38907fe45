"""Push asks: a consumer asks the producer holding a request's KV to write it into the
consumer's blocks (`KVTransferAgent.ask_push`), and the producer's `Pusher` writes each layer
once its KV is computed.

Both agents live in this process, each with its own UCX worker; ``network`` counts the producer
as another host (UCX puts over TCP). Bytes: the consumer's granted blocks must equal the
producer's, every other block keeps its sentinel. Guards: an ask needs the request's lease
(its secret, its blocks at their positions, not ended); a lease not recorded yet is answered
LEASE_NOT_GRANTED (asked again by the consumer); a push whose read lease ends mid-way ends
"stopped", which the consumer's `landed` raises as `WritesStopped`.
"""

from __future__ import annotations

import pytest
import torch
from transport_helpers.kv import LayerGroup, empty_caches, make_caches
from waiting import wait_until

from kvtransfer.transport import (
    ErrorCode,
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    RemoteTransferError,
    TransportConfig,
    WritesStopped,
    new_secret,
    pusher,
    secret_digest,
)

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 3)
SEED = 29
SENTINEL = -7.0
WAIT_S = 20.0
DEST = (7, 3, 9)
SOURCE = (1, 2, 5)


class Asking:
    """A producer serving a leased request with pushes, and a consumer that takes them."""

    def __init__(self, network: bool) -> None:
        self.read_grants = LeaseGrants(grant_wait_s=1.0)
        self.source = make_caches(SEED, [GROUP])
        self.producer = KVTransferAgent(
            TransportConfig(timeout_s=WAIT_S, shared_memory=not network)
        )
        self.producer.register_kv_caches(self.source)
        self.producer.start_server(self.read_grants, pushes=True)
        self.push_grants = LeaseGrants(grant_wait_s=1.0)
        self.local = empty_caches([GROUP])
        self.consumer = KVTransferAgent(TransportConfig(timeout_s=WAIT_S))
        self.consumer.register_kv_caches(self.local)
        self.consumer.start_server(push_grants=self.push_grants)
        self.peer = self.consumer.connect(self.producer.address, layouts=self.producer.kv_layouts())

    def lend(self, lease_id: str, pending=()) -> LeaseAccess:
        """The producer's lease of SOURCE (``pending``: layers still being computed)."""
        secret = new_secret()
        self.read_grants.grant(lease_id, secret_digest(secret), SOURCE, "p", pending)
        return LeaseAccess(lease_id, secret, "p", 0)

    def grant_push(self, lease_id: str) -> LeaseAccess:
        secret = new_secret()
        self.push_grants.grant_push(lease_id, secret_digest(secret), DEST, GROUP.names(), "q")
        return LeaseAccess(lease_id, secret, "q", 0)

    def ask(self, lease: LeaseAccess, push_lease: LeaseAccess, source=SOURCE) -> None:
        self.consumer.ask_push(
            self.peer,
            request_id="req",
            lease=lease,
            push_lease=push_lease,
            layer_names=GROUP.names(),
            block_ids=source,
            dest_block_ids=DEST,
        )

    def written(self) -> bool:
        for name in GROUP.names():
            expected = torch.full_like(self.local[name], SENTINEL)
            for remote, local in zip(DEST, SOURCE, strict=True):
                expected[remote] = self.source[name][local]
            if not torch.equal(self.local[name], expected):
                return False
        return True

    def untouched(self) -> bool:
        return all((cache == SENTINEL).all() for cache in self.local.values())

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()


@pytest.fixture(params=["direct", "network"])
def asking(request):
    setup = Asking(network=request.param == "network")
    yield setup
    setup.close()


def test_an_ask_is_pushed_layer_by_layer_as_the_kv_is_computed(asking):
    names = GROUP.names()
    lease = asking.lend("req", pending=names)
    push_lease = asking.grant_push("req-push")
    asking.ask(lease, push_lease)
    # Nothing computed yet: nothing written, nothing landed.
    assert not asking.push_grants.wait_landed("req-push", 0.3)
    assert asking.untouched()
    for done, name in enumerate(names, 1):
        asking.read_grants.layer_ready(["req"], name)
        if done < len(names):
            wait_until(
                lambda n=name: not (asking.local[n] == SENTINEL).all(), f"{name} written", WAIT_S
            )
            assert not asking.push_grants.landed("req-push")
    assert asking.push_grants.wait_landed("req-push", WAIT_S)
    assert asking.written()
    # The producer read its blocks as a reader of the lease: none is left reading them.
    asking.read_grants.revoke_nowait(["req"])
    assert asking.read_grants.drained(["req"]) == {"req"}


def test_an_ask_needs_the_request_lease_its_secret_and_its_blocks(asking):
    lease = asking.lend("req")
    push_lease = asking.grant_push("req-push")
    forged = LeaseAccess("req", new_secret(), "p", 0)
    with pytest.raises(RemoteTransferError) as refused:
        asking.ask(forged, push_lease)
    assert refused.value.code == ErrorCode.ACCESS_DENIED
    assert "wrong secret" in str(refused.value)
    with pytest.raises(RemoteTransferError) as unknown:
        asking.ask(LeaseAccess("other", lease.secret, "p", 0), push_lease)
    assert unknown.value.code == ErrorCode.LEASE_NOT_GRANTED
    # Blocks outside the lease, or the lease's in another order.
    for source, why in [((1, 2, 6), "block(s) 6 do not belong"), (SOURCE[::-1], "reordered")]:
        with pytest.raises(RemoteTransferError) as outside:
            asking.ask(lease, push_lease, source=source)
        assert outside.value.code == ErrorCode.ACCESS_DENIED and why in str(outside.value)
    assert asking.untouched()
    assert not asking.push_grants.landed("req-push")  # and no write begun on it


def test_a_lease_ended_mid_push_stops_it_typed(asking):
    names = GROUP.names()
    lease = asking.lend("req", pending=names)
    push_lease = asking.grant_push("req-push")
    asking.ask(lease, push_lease)
    asking.read_grants.layer_ready(["req"], names[0])
    wait_until(lambda: not (asking.local[names[0]] == SENTINEL).all(), "layer 0 written", WAIT_S)
    asking.read_grants.revoke(["req"], "has ended (aborted)")
    with pytest.raises(WritesStopped, match="lease 'req' has ended \\(aborted\\)"):
        wait_until(lambda: asking.push_grants.landed("req-push"), "the push to end", WAIT_S)
    with pytest.raises(RemoteTransferError) as late:
        asking.ask(lease, asking.grant_push("req-push-2"))
    assert late.value.code == ErrorCode.ACCESS_DENIED and "aborted" in str(late.value)


def test_asks_beyond_the_bound_are_refused_typed(asking, monkeypatch):
    monkeypatch.setattr(pusher, "MAX_ASKS", 1)
    names = GROUP.names()
    lease = asking.lend("req", pending=names)  # the first ask waits for its KV: it stays
    asking.ask(lease, asking.grant_push("req-push"))
    with pytest.raises(RemoteTransferError) as refused:
        asking.ask(lease, asking.grant_push("req-push-2"))
    assert refused.value.code == ErrorCode.NOT_SERVING
    assert "too many push asks" in str(refused.value)
    asking.read_grants.layer_ready(["req"])
    assert asking.push_grants.wait_landed("req-push", WAIT_S)
    # Room again once the first push ended (its thread counts it until it sent "landed").
    wait_until(lambda: asking.producer.push_asks_pending == 0, "the first push done", WAIT_S)
    asking.ask(lease, asking.grant_push("req-push-3"))
    assert asking.push_grants.wait_landed("req-push-3", WAIT_S)
