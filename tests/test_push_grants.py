"""The consumer's side of a push, as `LeaseGrants` keeps it: who may write which blocks, when a
push has landed, and when its blocks may be reused.

A push lease is granted with the layers to be written and how many producer workers write a
part of each (`grant_push`); a producer says it begins (`begin_write`, counted until its
`end_write`) and what landed. `landed` holds once every writer reported every layer and none
is writing; a lease ended while a writer is counted is not `drained` until it says it stopped,
or until its producer is known gone (`abandon_writes`).
"""

from __future__ import annotations

import pytest

from kvtransfer.transport import AccessDenied, LeaseAccess, LeaseGrants, new_secret, secret_digest
from kvtransfer.transport.access import LeaseNotGranted

pytestmark = pytest.mark.unit

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def _granted(writers: int = 1) -> tuple[LeaseGrants, LeaseAccess]:
    grants = LeaseGrants()
    secret = new_secret()
    grants.grant_push("r", secret_digest(secret), (4, 5), LAYERS, "p", writers=writers)
    return grants, LeaseAccess("r", secret, "p", 0, (4, 5))


def test_a_push_lands_once_every_writer_reported_every_layer_and_none_writes():
    grants, access = _granted(writers=2)
    assert not grants.landed("r")
    grants.begin_write(access)
    grants.begin_write(access)
    grants.end_write(access, LAYERS)
    assert not grants.landed("r")  # the second writer's heads are still due
    grants.end_write(access, LAYERS[:1])
    assert not grants.landed("r")  # and its second layer
    grants.begin_write(access)
    assert not grants.wait_landed("r", 0.01)  # a writer is counted
    grants.end_write(access, LAYERS[1:])
    assert grants.landed("r") and grants.wait_landed("r", 0.0)


def test_only_the_secret_s_holder_begins_or_ends_writes_and_only_what_it_began():
    grants, access = _granted()
    with pytest.raises(AccessDenied, match="wrong secret for lease 'r'"):
        grants.begin_write(LeaseAccess("r", new_secret(), "p"))
    with pytest.raises(AccessDenied, match="another prompt"):
        grants.begin_write(LeaseAccess("r", access.secret, "q"))
    with pytest.raises(LeaseNotGranted, match="'other' is unknown"):
        grants.begin_write(LeaseAccess("other", access.secret, "p"))
    with pytest.raises(AccessDenied, match="no write begun"):
        grants.end_write(access, LAYERS)
    grants.begin_write(access)
    with pytest.raises(AccessDenied, match="no write to end"):
        grants.end_write(LeaseAccess("r", new_secret(), "p"), LAYERS)
    assert not grants.landed("r")


def test_an_ended_lease_keeps_its_blocks_while_a_writer_is_counted():
    grants, access = _granted()
    grants.begin_write(access)
    grants.revoke_nowait(["r"])
    assert grants.drained(["r"]) == set()
    with pytest.raises(AccessDenied, match="push lease 'r' has ended"):
        grants.landed("r")
    with pytest.raises(AccessDenied, match="lease 'r' has ended"):
        grants.begin_write(access)  # a replay, or a late writer: refused
    grants.end_write(access, ())  # the writer says it stopped
    assert grants.drained(["r"]) == {"r"}


def test_a_gone_producer_s_writes_are_abandoned_and_a_lease_without_writers_drains_at_once():
    grants, access = _granted()
    grants.begin_write(access)
    grants.revoke_nowait(["r"])
    assert grants.drained(["r"]) == set()
    grants.abandon_writes(["r"])
    assert grants.drained(["r"]) == {"r"}
    fresh, _ = _granted()
    fresh.revoke_nowait(["r"])
    assert fresh.drained(["r"]) == {"r"}


def test_writers_must_be_a_positive_int():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="writers must be an int >= 1"):
            LeaseGrants().grant_push("r", b"d", (1,), LAYERS, writers=bad)
