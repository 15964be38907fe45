"""The data plane's "never waits" claims, proven with transfers held mid-way on an Event.

Each test holds one transfer inside its read (the consumer's copy of the bytes), its gather (the
producer's) or its keys request, by wrapping that one internal function so it waits on a
`threading.Event` the test sets, and requires what must not wait for it to end *while it is
still held*: the assertion is about order (returned before the release), never about time. A
hook that waited for the held transfer would never return before the release, so each test
fails on a waiting implementation instead of passing it slowly. The join bounds below only keep
such a failure from hanging the suite.

1. No worker hook waits for a transfer (`connectors.ucx.worker`): on a consumer, the step that
   learns of an aborted request whose load is reading returns, and the load is reported (its
   blocks given back) only once the read ended; the same through an engine's `abort_request`
   and steps. On a producer, the step that ends a lease a gather is reading returns, and the
   lease is reported sent (its blocks freed) only once the gather ended.
2. Queued reads fail fast (`transport.agent`, `transport.rma`): a one-sided read waiting for
   another read's keys request, or queued behind another read from the same producer, ends
   with its own typed cancellation or timeout while the read it waits behind is still held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers.builtin import DECODE, PROMPTS, engine_config, finish
from ucx_helpers.engines import kv_config, prefill, stepping, worker_half
from ucx_helpers.synthetic import SENTINEL, engines, expected_rank_cache
from waiting import wait_until

from kvtransfer.connectors.ucx import LoadSpec, UcxConnectorMetadata
from kvtransfer.connectors.ucx.metadata import Release
from kvtransfer.engine.engine_core import EngineCore
from kvtransfer.engine.llm import LLM
from kvtransfer.engine.scheduler.request import RequestStatus
from kvtransfer.transport import (
    KVTransferAgent,
    LeaseAccess,
    LeaseGrants,
    PullSpec,
    TransferCancelled,
    TransferTimeoutError,
    TransportConfig,
    new_secret,
    secret_digest,
)
from kvtransfer.transport import client as client_module
from kvtransfer.transport import rma as rma_module
from kvtransfer.transport import server as server_module

pytestmark = pytest.mark.integration

SEED = 7
REMOTE_IDS = (5, 17, 2, 9, 23)
LOCAL_IDS = (0, 11, 3, 20, 4)
# Generous bounds for what must happen (a loaded 2-core CI machine); a hook that waits for a held
# transfer never returns before its release, whatever the bound. Below `access._REVOKE_WAIT_S`
# (30 s), so a step that waited on a gather and then gave up would still fail here.
RETURN_S = 20.0
WAIT_S = 30.0
# A held transfer lets go by itself after this, so a broken test cannot hang the suite.
HOLD_CAP_S = 300.0


class Hold:
    """Wraps one function so that every call waits until `release` (set by the test)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            self.released.wait(HOLD_CAP_S)
            return fn(*args, **kwargs)

        return held

    def wait_entered(self, what: str) -> None:
        assert self.entered.wait(WAIT_S), f"{what}: never reached the held function"

    def release(self) -> None:
        self.released.set()


def returns_while_held(hold: Hold, fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on a thread of its own and return its value, requiring that it returned while
    ``hold`` still held its transfer (a ``fn`` that waits for the transfer never does)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"hook: {what}", daemon=True)
    thread.start()
    thread.join(RETURN_S)
    assert not thread.is_alive(), f"{what} waited for the held transfer"
    assert not hold.released.is_set(), f"{what} returned only after the transfer was released"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# ---------------------------------------------------------------- 1. no worker hook waits


def _hold_the_consumers_copy(plane: str, monkeypatch: pytest.MonkeyPatch) -> Hold:
    """Hold a consumer's read where it writes the bytes: one-sided, the copy of the data runs
    (direct or UCX gets; the lease-row reads are apart); tagged, the scatter of a received
    answer into the cache (under the pull's write lock, which its cancel takes)."""
    hold = Hold()
    if plane == "rma":
        for channel in (rma_module._DirectChannel, rma_module._UcxChannel):
            monkeypatch.setattr(channel, "copy", hold.wrap(channel.copy))
    else:
        monkeypatch.setattr(client_module, "scatter_from", hold.wrap(client_module.scatter_from))
    return hold


def _reported(worker, req_id: str) -> Callable[[], Any]:
    """A predicate collecting ``worker``'s transfer results until ``req_id`` is reported."""
    seen: list[tuple] = []

    def reported() -> Any:
        results = worker.get_transfer_results(set())
        if results != (None, None, None):
            seen.append(results)
        return seen

    return reported


@pytest.mark.parametrize("plane", ["rma", "tagged"])
def test_an_abort_reaches_the_consumer_without_waiting_for_the_held_read(plane, monkeypatch):
    """The step that tells the worker the request was aborted returns while the load's read is
    held, and so do the steps after it; the load is reported (failed, no load errors: its
    blocks go back to the engine) only after the read ended."""
    hold = _hold_the_consumers_copy(plane, monkeypatch)
    plane_of = {"data_plane": plane}
    with engines(
        {"engine_id": "held-p", "tp": 1, "pp": 1, "role": "kv_producer", "seed": SEED, **plane_of},
        {"engine_id": "held-c", "tp": 1, "pp": 1, "role": "kv_consumer", **plane_of},
    ) as (p, c):
        worker = c.workers[(0, 0)]
        spec = LoadSpec.one_group("held", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        worker.bind_connector_metadata(UcxConnectorMetadata(loads=(spec,)))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        try:
            hold.wait_entered("the load's read")
            # The abort: the request is in the step's finished ids.
            first = returns_while_held(
                hold, lambda: worker.get_transfer_results({"held"}), "the step with the abort"
            )
            assert first == (None, None, None)

            def next_step() -> Any:
                worker.bind_connector_metadata(UcxConnectorMetadata())
                worker.start_load_kv(None)
                worker.clear_connector_metadata()
                return worker.get_transfer_results(set())

            for _ in range(3):
                # Not reported while its read may still write into the blocks.
                assert returns_while_held(hold, next_step, "a later step") == (None, None, None)
            assert worker.worker_half.load_job("held") is not None
        finally:
            hold.release()
        seen = wait_until(_reported(worker, "held"), "the aborted load reported", WAIT_S)
        assert seen == [(None, {"held"}, {"held"})]
        assert worker.worker_half.load_job("held") is None
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker.get_load_failure_reasons() == {}
        assert worker.get_kv_connector_stats().data["num_loads_cancelled"] == 1


def test_an_engines_abort_and_steps_return_while_the_read_is_held(monkeypatch):
    """Through a real consumer engine: `abort_request` and every step return while the load's
    read is held, the aborted request's blocks stay borrowed meanwhile, and they are freed only
    after the read ended."""
    hold = _hold_the_consumers_copy("rma", monkeypatch)
    with LLM(engine_config(kv_config("kv_producer", "held-prefill"))) as producer:
        (output,) = prefill(producer, [PROMPTS[3]])
        core = EngineCore(engine_config(kv_config("kv_consumer", "held-decode")))
        try:
            with stepping(producer.engine):
                _abort_while_held(core, output.kv_transfer_params, hold)
        finally:
            hold.release()
            core.shutdown()
        finish(producer.engine)


def _abort_while_held(core: EngineCore, params: dict[str, Any], hold: Hold) -> None:
    core.add_request("d", PROMPTS[3], DECODE, params)
    core.step()
    assert core.scheduler.get_request("d").status is RequestStatus.WAITING_FOR_REMOTE_KVS
    try:
        hold.wait_entered("the decode's load")
        used = core.scheduler.block_manager.num_used_blocks
        assert used > 0
        (aborted,) = returns_while_held(hold, lambda: core.abort_request(["d"]), "abort_request")
        assert aborted.finish_reason == "abort"
        for _ in range(3):
            returns_while_held(hold, core.step, "a step after the abort")
            # Still borrowed by the load: its read may write into them.
            assert core.scheduler.block_manager.num_used_blocks == used
        assert worker_half(core).load_job("d") is not None
    finally:
        hold.release()

    def freed() -> bool:
        core.step()
        return core.scheduler.block_manager.num_used_blocks == 0

    wait_until(freed, "the aborted load's blocks freed after the read", WAIT_S)
    assert worker_half(core).load_job("d") is None
    finish(core)


@pytest.mark.parametrize("ending", ["released", "expired"])
def test_a_lease_ended_while_a_gather_reads_it_frees_its_blocks_after_the_gather(
    ending, monkeypatch
):
    """Tagged producer: its consumer's pull is being gathered (held) when the lease ends (the
    consumer said it was done, or the lease ran out). The producer's step that ends it and the
    steps after return while the gather is held, and the lease is reported sent (the engine
    frees its blocks) only after the gather ended."""
    hold = Hold()
    monkeypatch.setattr(
        server_module.KVServer, "_gather", hold.wrap(server_module.KVServer._gather)
    )
    tagged = {"data_plane": "tagged"}
    with engines(
        {"engine_id": "gather-p", "tp": 1, "pp": 1, "role": "kv_producer", "seed": SEED, **tagged},
        {"engine_id": "gather-c", "tp": 1, "pp": 1, "role": "kv_consumer", **tagged},
    ) as (p, c):
        remote = p.remote("pre", REMOTE_IDS)
        consumer = c.workers[(0, 0)]
        spec = LoadSpec.one_group("load", remote, REMOTE_IDS, LOCAL_IDS)
        consumer.bind_connector_metadata(UcxConnectorMetadata(loads=(spec,)))
        consumer.start_load_kv(None)
        consumer.clear_connector_metadata()
        producer = p.workers[(0, 0)]
        leases = p.scheduler.scheduler_half.leases
        try:
            hold.wait_entered("the producer's gather")
            if ending == "released":
                assert leases.finish([("pre", len(REMOTE_IDS), remote.secret)]) == ["pre"]
                releases = tuple(leases.take())
            else:
                releases = (Release("pre", expired=True),)
            assert [r.req_id for r in releases] == ["pre"]

            def step(**metadata: Any) -> Any:
                producer.bind_connector_metadata(UcxConnectorMetadata(**metadata))
                producer.start_load_kv(None)
                producer.clear_connector_metadata()
                return producer.get_transfer_results(set())

            # The step that ends the lease, then more: none reports it sent while it is read.
            ended = returns_while_held(hold, lambda: step(releases=releases), "the lease's end")
            assert ended == (None, None, None)
            for _ in range(3):
                assert returns_while_held(hold, step, "a later step") == (None, None, None)
        finally:
            hold.release()
        seen = wait_until(_reported(producer, "pre"), "the lease reported sent", WAIT_S)
        assert seen == [({"pre"}, None, None)]
        # The consumer's load ends either way: read (the gather began while the lease was
        # held, so it read the lease's own KV), or failed (its liveness probe heard that the
        # producer no longer holds the request).
        loaded = wait_until(_reported(consumer, "load"), "the consumer's load reported", WAIT_S)
        ((_, recving, failed),) = loaded
        assert recving == {"load"}
        if failed is None:
            for name, cache in c.caches[(0, 0)].items():
                wanted = expected_rank_cache(SEED, name, (0, 0), 1, REMOTE_IDS, LOCAL_IDS)
                assert torch.equal(cache, wanted), name


# ---------------------------------------------------------------- 2. queued reads fail fast


class _Leased:
    """An RMA producer agent serving leased KV and a consumer agent, in this process; with
    ``network`` the consumer counts as another host (UCX gets, under the producer's read lock),
    else it reads the producer's memory directly."""

    def __init__(self, network: bool) -> None:
        self.grants = LeaseGrants(grant_wait_s=1.0)
        self.source = {f"model.layers.{i}.self_attn": torch.randn(16, 2, 2, 8, 4) for i in range(2)}
        self.producer = KVTransferAgent(TransportConfig(timeout_s=WAIT_S))
        self.producer.register_kv_caches(self.source)
        self.producer.start_server(self.grants)
        self.local = {name: torch.full_like(t, SENTINEL) for name, t in self.source.items()}
        self.consumer = KVTransferAgent(
            TransportConfig(timeout_s=WAIT_S, shared_memory=not network)
        )
        self.consumer.register_kv_caches(self.local)
        self.peer = self.consumer.connect(
            self.producer.address, layouts=self.producer.kv_layouts(), one_sided=True
        )

    def grant(self, lease_id: str, blocks: tuple[int, ...]) -> LeaseAccess:
        secret = new_secret()
        self.grants.grant(lease_id, secret_digest(secret), blocks)
        return LeaseAccess(lease_id, secret, "", 0, blocks)

    def pull(self, lease_id: str, remote: tuple[int, ...], local: tuple[int, ...], **kwargs):
        lease = self.grant(lease_id, remote)
        spec = PullSpec(lease_id, list(self.source), remote, local, lease=lease)
        return self.consumer.pull(self.peer, spec, **kwargs)

    def untouched(self, blocks: tuple[int, ...]) -> bool:
        return all(bool((cache[list(blocks)] == SENTINEL).all()) for cache in self.local.values())

    def landed(self, remote: tuple[int, ...], local: tuple[int, ...]) -> bool:
        return all(
            torch.equal(self.local[name][list(local)], self.source[name][list(remote)])
            for name in self.source
        )

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


def _in_thread(fn: Callable[[], Any], name: str) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, outcome


def _queued_read_ends_on_its_own(leased: _Leased, hold: Hold, how: str) -> None:
    """With the first read held, a second read from the same producer waits; stopped by its
    own cancel or deadline, it ends typed while the first is still held, having written
    nothing; then the first completes."""
    first, first_outcome = _in_thread(lambda: leased.pull("first", (4, 5), (0, 1)), "first read")
    hold.wait_entered("the first read")
    polled = threading.Event()
    stop = threading.Event()

    def should_stop() -> bool:
        polled.set()  # the queued read checks its cancel flag: it waits
        return stop.is_set()

    timeout_s = 0.5 if how == "deadline" else WAIT_S
    second, second_outcome = _in_thread(
        lambda: leased.pull("second", (6, 7), (2, 3), should_stop=should_stop, timeout_s=timeout_s),
        "queued read",
    )
    try:
        assert polled.wait(WAIT_S), "the queued read never checked its cancel flag"
        if how == "cancelled":
            stop.set()
        second.join(RETURN_S)
        assert not second.is_alive(), "the queued read waited for the held read"
        assert not hold.released.is_set()
        assert first.is_alive(), "the first read ended although held"
        assert "error" not in second_outcome, second_outcome.get("error")
        handle = second_outcome["value"]
        assert handle.done()
        expected = TransferCancelled if how == "cancelled" else TransferTimeoutError
        with pytest.raises(expected):
            handle.result(0)
        assert leased.untouched((2, 3))
    finally:
        hold.release()
    first.join(WAIT_S)
    assert not first.is_alive() and "error" not in first_outcome, first_outcome.get("error")
    first_outcome["value"].result(WAIT_S)
    assert leased.landed((4, 5), (0, 1))
    assert hold.calls == 1  # the queued read never reached what was held


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_read_waiting_for_another_reads_keys_request_fails_fast(how, monkeypatch):
    """The first one-sided read from a producer asks for its keys (held here, on the consumer,
    once the request is made); a second read to the same producer waits for those keys and
    ends at its own cancel or deadline, while the keys request is still held."""
    leased = _Leased(network=False)
    hold = Hold()
    fetch = client_module.PullClient.fetch_keys
    monkeypatch.setattr(client_module.PullClient, "fetch_keys", hold.wrap(fetch))
    try:
        _queued_read_ends_on_its_own(leased, hold, how)
    finally:
        hold.release()
        leased.close()


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_read_queued_behind_another_read_from_the_producer_fails_fast(how, monkeypatch):
    """Over UCX gets (another host), reads from one producer take turns on its unpacked keys:
    with the first held inside its data gets, a second waits its turn and ends at its own
    cancel or deadline, while the first is still held."""
    leased = _Leased(network=True)
    try:
        leased.pull("keys", (1,), (1,)).result(WAIT_S)  # the keys, fetched once
        hold = Hold()
        channel = rma_module._UcxChannel
        monkeypatch.setattr(channel, "copy", hold.wrap(channel.copy))
        try:
            _queued_read_ends_on_its_own(leased, hold, how)
        finally:
            hold.release()
        rma = leased.consumer._rma_peers[leased.peer.ucx_address]
        assert rma.direct is None  # the path meant: UCX gets
    finally:
        leased.close()
