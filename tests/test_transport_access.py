"""The data plane as a security boundary: leases, secrets, block ownership, checksums.

A serving agent with `LeaseGrants` and a pulling agent run in this process over real UCX (the
grants are driven from the test); a rogue server built on the raw `UcxLoop` sends a payload
that does not match its checksum.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transport_helpers.kv import LayerGroup, empty_caches, make_caches
from waiting import wait_until

from kvtransfer.transport import (
    AccessDenied,
    CorruptPayloadError,
    ErrorCode,
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PullSpec,
    RemoteTransferError,
    TransportConfig,
    new_secret,
    secret_digest,
)
from kvtransfer.transport.messages import (
    REQUEST_TAG,
    PullRequestMessage,
    PullResponseHeader,
    encode_address,
    payload_tag,
)
from kvtransfer.transport.ucx import UcxLoop

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 2)
SEED = 5
WAIT_S = 30.0


@pytest.fixture(scope="module")
def served():
    grants = LeaseGrants(grant_wait_s=1.0)
    # Checksums on: every pull of this module is verified, so none may be a false alarm.
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S, checksum=True)) as server:
        server.register_kv_caches(make_caches(SEED, [GROUP]))
        server.start_server(grants)
        yield server, grants


@pytest.fixture(scope="module")
def client():
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S)) as agent:
        agent.register_kv_caches(empty_caches([GROUP]))
        yield agent


def _pull(client, server, remote_ids, lease, local_ids=None):
    local = list(range(len(remote_ids))) if local_ids is None else local_ids
    peer = client.connect(server.address)
    spec = PullSpec("decode-1", GROUP.names(), remote_ids, local, lease=lease)
    return client.pull(peer, spec).result(WAIT_S)


def _grant(grants, lease_id, block_ids):
    secret = new_secret()
    grants.grant(lease_id, secret_digest(secret), block_ids)
    return LeaseAccess(lease_id, secret)


def _refused(client, server, remote_ids, lease, match, code=ErrorCode.ACCESS_DENIED):
    with pytest.raises(RemoteTransferError, match=match) as info:
        _pull(client, server, remote_ids, lease)
    assert info.value.code == code


def test_the_lease_holder_reads_exactly_its_blocks(served, client):
    server, grants = served
    access = _grant(grants, "req-own", [3, 4, 5])
    _pull(client, server, [4, 5], access.at(1))
    remote = server.kv_caches
    for name in GROUP.names():
        assert torch.equal(client.kv_caches[name][0], remote[name][4])
        assert torch.equal(client.kv_caches[name][1], remote[name][5])


def test_a_wrong_secret_is_refused(served, client):
    server, grants = served
    _grant(grants, "req-secret", [1])
    _refused(client, server, [1], LeaseAccess("req-secret", new_secret()), "wrong secret")


def test_blocks_outside_the_lease_are_refused(served, client):
    server, grants = served
    access = _grant(grants, "req-blocks", [7, 8])
    _refused(client, server, [7, 9], access, r"block\(s\) 9 do not belong to lease 'req-blocks'")


def test_another_requests_lease_cannot_be_used_with_this_secret(served, client):
    server, grants = served
    mine = _grant(grants, "req-mine", [10])
    _grant(grants, "req-theirs", [11])
    _refused(client, server, [11], LeaseAccess("req-theirs", mine.secret), "wrong secret")
    _refused(client, server, [11], mine, r"block\(s\) 11 do not belong")


def test_a_pull_without_a_lease_is_refused(served, client):
    server, _ = served
    _refused(client, server, [0], None, "presents no lease")


def test_an_ended_lease_is_refused_at_once(served, client):
    server, grants = served
    access = _grant(grants, "req-ended", [12])
    _pull(client, server, [12], access)
    grants.revoke(["req-ended"])
    started = time.monotonic()
    _refused(client, server, [12], access, "lease 'req-ended' has ended")
    # Remembered as ended: refused without waiting out grant_wait_s.
    assert time.monotonic() - started < grants.grant_wait_s


def test_an_unknown_lease_is_refused_after_the_grant_wait(served, client):
    server, _ = served
    # Its own code: a reader that knows the producer holds the request may ask again (the
    # grant may still be on its way to this worker).
    _refused(
        client,
        server,
        [0],
        LeaseAccess("req-never", new_secret()),
        "is unknown",
        ErrorCode.LEASE_NOT_GRANTED,
    )


@pytest.fixture(scope="module")
def patient():
    """A server whose pulls wait for their grant far longer than any test step takes, so a
    parked pull is still parked when the test looks at it, however slow the machine."""
    grants = LeaseGrants(grant_wait_s=WAIT_S)
    with KVTransferAgent(TransportConfig(timeout_s=WAIT_S, checksum=True)) as server:
        server.register_kv_caches(make_caches(SEED, [GROUP]))
        server.start_server(grants)
        yield server, grants


def _parked_leases(agent) -> list[str]:
    """The leases of the pulls ``agent``'s server holds back until their grant comes.

    Reads the private ``KVServer._parked`` (``(deadline, (lease_id, layer_names, request))``
    entries, under ``_parked_lock``): nothing public tells a parked pull from one that has not
    arrived yet, and which of the two it is is what the test checks.
    """
    server = agent.server
    with server._parked_lock:
        return [lease_id for _, (lease_id, _, _) in server._parked]


def test_a_pull_that_arrives_before_its_grant_is_parked_then_served(patient, client):
    server, grants = patient
    counters = server.server
    served, rejected = counters.requests_served, counters.requests_rejected
    secret = new_secret()
    peer = client.connect(server.address)
    spec = PullSpec(
        "decode-late", GROUP.names(), [13, 14], [0, 1], lease=LeaseAccess("req-late", secret)
    )
    pending = client.pull(peer, spec)
    wait_until(
        lambda: pending.done() or "req-late" in _parked_leases(server),
        "the pull parked (or answered)",
        WAIT_S,
    )
    # Parked: received, but neither answered nor refused while its grant is missing.
    assert not pending.done(), f"answered before its grant: {pending.exception()!r}"
    assert _parked_leases(server) == ["req-late"]
    assert (counters.requests_served, counters.requests_rejected) == (served, rejected)
    grants.grant("req-late", secret_digest(secret), [13, 14])
    pending.result(WAIT_S)
    # Served by the parked path: unparked by the grant, answered once, never refused.
    assert _parked_leases(server) == []
    assert counters.requests_served == served + pending.messages_received > served
    assert counters.requests_rejected == rejected
    for name in GROUP.names():
        assert torch.equal(client.kv_caches[name][0:2], server.kv_caches[name][13:15]), name


def test_revoke_waits_for_a_running_gather():
    grants = LeaseGrants()
    access = LeaseAccess("r", "s")
    # A layer still pending makes `ready` tell a granted lease (False) from an ended one (True).
    grants.grant("r", secret_digest("s"), [1], pending_layers=["later"])
    order = []
    with grants.reading(access, [1]):
        revoker = threading.Thread(target=lambda: (grants.revoke(["r"]), order.append("revoked")))
        revoker.start()
        wait_until(lambda: grants.ready("r", ["later"]), "the revoke under way", 5)
        order.append("gather done")
    revoker.join(5)
    assert order == ["gather done", "revoked"]


def test_revoke_nowait_ends_a_lease_at_once_and_tells_when_its_gathers_ended():
    # What an engine step uses: it must not wait for a gather, only learn when it is over.
    grants = LeaseGrants()
    access = LeaseAccess("r", "s")
    grants.grant("r", secret_digest("s"), [1, 2])
    grants.grant("idle", secret_digest("s"), [3])
    with grants.reading(access, [1]):
        grants.revoke_nowait(["r", "idle"], "has ended (released)")
        with (
            pytest.raises(AccessDenied, match=r"lease 'r' has ended \(released\)"),
            grants.reading(access, [2]),
        ):
            pass
        assert grants.drained(["r", "idle"]) == {"idle"}
        assert grants.drained(["r"]) == set()
    assert grants.drained(["r"]) == {"r"}
    assert grants.lease_ids() == []


def test_the_secret_is_never_printed():
    assert "s3cret" not in repr(LeaseAccess("r", "s3cret"))


@pytest.fixture
def rogue_server():
    """Answers every pull with the right size and a checksum of other bytes."""
    loop = UcxLoop(name="rogue")
    payloads = []

    def answer(data, error):
        if error is not None:
            return
        request = PullRequestMessage.decode(data)
        body = torch.full((request.payload_bytes,), 7, dtype=torch.uint8)
        payloads.append(body)
        header = PullResponseHeader(ErrorCode.OK, request.payload_bytes, checksum=12345)
        loop.send(request.reply_address, header.encode(), request.reply_tag)
        loop.send(request.reply_address, body, payload_tag(request.reply_tag))

    loop.call(lambda: loop.listen(REQUEST_TAG, answer)).result(WAIT_S)
    yield loop
    loop.close()


def test_a_corrupt_payload_is_a_typed_failure_and_never_written(client, rogue_server):
    before = {name: t.clone() for name, t in client.kv_caches.items()}
    peer = client.connect(encode_address(rogue_server.address))
    spec = PullSpec("corrupt", GROUP.names(), [0, 1], [20, 21])
    with pytest.raises(CorruptPayloadError, match=r"payload from peer-\w+ is corrupt"):
        client.pull(peer, spec).result(WAIT_S)
    for name, tensor in client.kv_caches.items():
        assert torch.equal(tensor, before[name])


@pytest.mark.parametrize(
    ("remote_ids", "offset", "match"),
    [
        ([16, 15], 0, r"not lease 'req-order''s blocks at positions \[0, 2\)"),
        ([15, 15], 0, r"not lease 'req-order''s blocks at positions \[0, 2\)"),
        ([16, 17], 0, r"not lease 'req-order''s blocks at positions \[0, 2\)"),
        ([15, 16], 1, r"not lease 'req-order''s blocks at positions \[1, 3\)"),
    ],
    ids=["reordered", "repeated", "shifted", "wrong-offset"],
)
def test_blocks_must_be_the_lease_s_in_order(served, client, remote_ids, offset, match):
    server, grants = served
    secret = new_secret()
    grants.grant("req-order", secret_digest(secret), [15, 16, 17], "d" * 64)
    _refused(client, server, remote_ids, LeaseAccess("req-order", secret, "d" * 64, offset), match)
    # The lease's own blocks, from any position, in order, are served.
    _pull(client, server, [16, 17], LeaseAccess("req-order", secret, "d" * 64, 1))


def test_a_pull_for_another_prompt_is_refused(served, client):
    server, grants = served
    secret = new_secret()
    grants.grant("req-prompt", secret_digest(secret), [18], "a" * 64)
    access = LeaseAccess("req-prompt", secret, "b" * 64)
    _refused(client, server, [18], access, "holds the KV of another prompt")


# ---------------------------------------------------------------------- layer-wise streaming


def test_a_streaming_lease_serves_each_layer_once_computed_and_none_before(served, client):
    """A lease granted while its KV is computed: a pull of a layer waits (parked, however
    long past the grant wait) until that layer is ready; the other layer is served at once."""
    server, grants = served
    first, second = GROUP.names()
    secret = new_secret()
    grants.grant("req-stream", secret_digest(secret), [20, 21], pending_layers=[first, second])
    lease = LeaseAccess("req-stream", secret)
    assert not grants.ready("req-stream", [first]) and not grants.ready("req-stream", [second])
    peer = client.connect(server.address)
    waiting = client.pull(peer, PullSpec("decode-s", (first,), [20, 21], [5, 6], lease=lease))
    grants.layer_ready(["req-stream"], second)
    second_pull = PullSpec("decode-s", (second,), [20, 21], [5, 6], lease=lease)
    client.pull(peer, second_pull).result(WAIT_S)
    # Not synchronisation: time must pass grant_wait_s (1 s); a pending layer's pull still waits.
    time.sleep(1.5)
    assert not waiting.done()
    grants.layer_ready(["req-stream"], first)
    waiting.result(WAIT_S)
    for name in GROUP.names():
        assert torch.equal(client.kv_caches[name][5:7], server.kv_caches[name][20:22]), name


def test_a_streaming_lease_revoked_mid_stream_refuses_its_waiting_pulls(served, client):
    server, grants = served
    first, _ = GROUP.names()
    secret = new_secret()
    grants.grant("req-gone", secret_digest(secret), [22], pending_layers=GROUP.names())
    peer = client.connect(server.address)
    spec = PullSpec("decode-g", (first,), [22], [7], lease=LeaseAccess("req-gone", secret))
    waiting = client.pull(peer, spec)
    grants.revoke(["req-gone"])  # the prefill was aborted while computing
    with pytest.raises(RemoteTransferError, match="has ended") as info:
        waiting.result(WAIT_S)
    assert info.value.code == ErrorCode.ACCESS_DENIED


def test_reading_a_layer_still_computed_is_refused_naming_it():
    grants = LeaseGrants()
    grants.grant("r", secret_digest("s"), [1], pending_layers=["a", "b"])
    refused = pytest.raises(PermissionError, match=r"layer\(s\) a is still being computed")
    with refused, grants.reading(LeaseAccess("r", "s"), [1], ["a"]):
        pass
    grants.layer_ready(["r"])  # every layer
    assert grants.ready("r", ["a", "b"])
    with grants.reading(LeaseAccess("r", "s"), [1], ["a", "b"]):
        pass
