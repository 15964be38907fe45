"""What a one-sided read costs the consumer's CPU while it waits (issue 36 item 9: nothing
bounded it). A read waits on the calling thread, for its lease row (the grant reaches the
producer's workers once a step) or for UCX gets a frozen producer never answers; it must nap
between polls, never spin: its thread's CPU time (`time.thread_time`, which a busy host does
not inflate) stays a small share of the time it waited. A spinning wait takes about all of it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from transport_helpers.kv import LayerGroup, empty_caches, make_caches
from transport_helpers.procs import ServerSpec, freeze, kv_servers

from kvtransfer.transport import (
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PullSpec,
    TransferTimeoutError,
    TransportConfig,
    new_secret,
    secret_digest,
)

pytestmark = pytest.mark.integration

GROUP = LayerGroup("model.layers", 0, 3)
WAIT_S = 1.5
# The most of the waited time the waiting thread may spend on a CPU: a spin is close to 100 %.
MAX_CPU_SHARE = 0.1


def _cpu_while(run) -> tuple[float, float]:
    """(this thread's CPU seconds, wall seconds) of ``run()``."""
    cpu, wall = time.thread_time(), time.monotonic()
    run()
    return time.thread_time() - cpu, time.monotonic() - wall


@pytest.mark.parametrize("network", [False, True], ids=["direct", "network"])
def test_a_read_waiting_for_its_lease_row_naps(network):
    grants = LeaseGrants(grant_wait_s=10.0)
    with KVTransferAgent(TransportConfig(grant_wait_s=10.0)) as producer:
        producer.register_kv_caches(make_caches(5, [GROUP]))
        producer.start_server(grants)
        config = TransportConfig(timeout_s=30.0, grant_wait_s=10.0, shared_memory=not network)
        with KVTransferAgent(config) as consumer:
            consumer.register_kv_caches(empty_caches([GROUP]))
            peer = consumer.connect(producer.address, layouts=producer.kv_layouts(), one_sided=True)
            first = new_secret()
            grants.grant("first", secret_digest(first), (1,))
            keys = LeaseAccess("first", first, "", 0, (1,))
            consumer.pull(peer, PullSpec("keys", GROUP.names(), (1,), (1,), lease=keys)).result(30)
            secret = new_secret()
            late = LeaseAccess("late", secret, "", 0, (2, 3))
            timer = threading.Timer(
                WAIT_S, lambda: grants.grant("late", secret_digest(secret), (2, 3))
            )
            timer.start()
            spec = PullSpec("late", GROUP.names(), (2, 3), (2, 3), lease=late)
            cpu, wall = _cpu_while(lambda: consumer.pull(peer, spec).result(30))
            timer.join()
    assert wall >= WAIT_S  # it did wait for the grant
    assert cpu < MAX_CPU_SHARE * wall, (cpu, wall)


def test_a_read_of_a_frozen_producer_naps_until_its_deadline():
    """UCX gets to a frozen (SIGSTOPped) producer over the network never complete: the read
    waits until its own deadline, napping, and fails typed."""
    with kv_servers([ServerSpec(9, (GROUP,))]) as (server,):
        config = TransportConfig(timeout_s=WAIT_S, shared_memory=False)
        with KVTransferAgent(config) as consumer:
            consumer.register_kv_caches(empty_caches([GROUP]))
            peer = consumer.connect(server.address, layouts=server.layouts, one_sided=True)
            spec = PullSpec("warm", GROUP.names(), (1,), (1,))
            consumer.pull(peer, spec).result(30)  # keys fetched, endpoint up
            freeze(server.process.pid)
            try:
                frozen = PullSpec("frozen", GROUP.names(), tuple(range(64)), tuple(range(64)))

                def read() -> None:
                    with pytest.raises(TransferTimeoutError):
                        consumer.pull(peer, frozen).result(30)

                cpu, wall = _cpu_while(read)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
    assert wall >= WAIT_S
    assert cpu < MAX_CPU_SHARE * wall, (cpu, wall)
