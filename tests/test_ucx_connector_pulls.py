"""`UcxConnector`'s data path between synthetic engines (bare connector halves, seeded caches):
real gRPC handshakes and real UCX pulls for many TP x PP pairings, replicated heads and drafter
layers included; every layer and head slice of every consumer worker is checked byte for byte,
and failures are reported as failed loads with their blocks."""

from __future__ import annotations

import logging
import re
import socket
import threading

import pytest
import torch
from ucx_helpers.synthetic import (
    SENTINEL,
    SyntheticEngine,
    engines,
    expected_rank_cache,
    run_load,
    start_engine,
)
from waiting import wait_until

from kvtransfer.connectors.ucx import LoadSpec, UcxConnectorMetadata

pytestmark = pytest.mark.integration

SEED = 7
REMOTE_IDS = (5, 17, 2, 9, 23)
LOCAL_IDS = (0, 11, 3, 20, 4)

# (producer TP, PP) -> (consumer TP, PP); 2 KV heads, so TP 4 replicates each head twice.
SPLITS = [
    ((1, 1), (1, 1)),
    ((2, 1), (1, 1)),
    ((1, 1), (2, 1)),
    ((1, 2), (1, 1)),
    ((1, 1), (1, 2)),
    ((2, 2), (1, 2)),
    ((4, 1), (1, 1)),
    ((1, 2), (4, 2)),
    ((4, 2), (2, 1)),
]


class EnginePool:
    """Synthetic engines started on first use and shared by the module's tests, all on one
    data plane (the module runs once per plane)."""

    def __init__(self, data_plane: str) -> None:
        self.data_plane = data_plane
        self._engines: dict[tuple, SyntheticEngine] = {}

    def engines(self, *specs: dict):
        """`engines` on this pool's data plane."""
        return engines(*({**spec, "data_plane": self.data_plane} for spec in specs))

    def get(self, role: str, tp: int, pp: int) -> SyntheticEngine:
        key = (role, tp, pp)
        if key not in self._engines:
            seed = SEED if role == "kv_producer" else None
            self._engines[key] = start_engine(
                f"{role}-{tp}x{pp}", tp, pp, role, seed=seed, data_plane=self.data_plane
            )
        engine = self._engines[key]
        if role == "kv_consumer":
            # Earlier tests loaded into it: back to "nothing written" (in place, the agent
            # holds these tensors).
            for caches in engine.caches.values():
                for cache in caches.values():
                    cache.fill_(SENTINEL)
        return engine

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


@pytest.fixture(scope="module", params=["rma", "tagged", "push"])
def pool(request):
    pool = EnginePool(request.param)
    yield pool
    pool.shutdown()


def _check_caches(consumer: SyntheticEngine, remote_ids, local_ids) -> None:
    for rank, caches in consumer.caches.items():
        for name, cache in caches.items():
            expected = expected_rank_cache(
                SEED, name, rank, consumer.tp_size, remote_ids, local_ids
            )
            assert torch.equal(cache, expected), f"{name} on consumer rank {rank}"


@pytest.mark.parametrize(("producer", "consumer"), SPLITS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_layer_and_head_slice_arrives(pool, producer, consumer):
    p = pool.get("kv_producer", *producer)
    c = pool.get("kv_consumer", *consumer)
    spec = LoadSpec.one_group("req", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
    results = run_load(c, spec)
    assert results == {rank: ({"req"}, set(), set()) for rank in c.workers}
    _check_caches(c, REMOTE_IDS, LOCAL_IDS)
    if pool.data_plane == "push":
        # Written by the producer's ranks, not read by the consumer's.
        for rank, worker in c.workers.items():
            stats = worker.worker_half.stats()
            assert stats is not None and stats.data.get("num_loads_pushed") == 1, rank


def _plan(consumer: SyntheticEngine, rank, producer: SyntheticEngine):
    (engine,) = [
        e
        for e in consumer.workers[rank].worker_half.remote_engines
        if e.engine_id == producer.engine_id
    ]
    return [(p.remote_rank, p.layer_names, p.remote_heads, p.local_heads) for p in engine.plan]


def test_replicated_heads_are_read_once_and_layers_from_their_stage(pool):
    p = pool.get("kv_producer", 4, 2)
    c = pool.get("kv_consumer", 2, 1)
    run_load(c, LoadSpec.one_group("plan", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS))
    # Consumer tp 1 holds head 1; producer ranks tp 2 and 3 both hold it: read from tp 2 only.
    assert _plan(c, (0, 1), p) == [
        (
            (0, 2),
            ("model.layers.0.self_attn", "model.layers.1.self_attn"),
            range(0, 1),
            range(0, 1),
        ),
        (
            (1, 2),
            (
                "model.layers.2.self_attn",
                "model.layers.3.self_attn",
                "draft.layers.0.self_attn",
                "draft.layers.1.self_attn",
            ),
            range(0, 1),
            range(0, 1),
        ),
    ]
    # A consumer with both heads reads each from one producer TP rank per stage.
    single = pool.get("kv_consumer", 1, 1)
    run_load(
        single, LoadSpec.one_group("plan1", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
    )
    assert [(rank, heads) for rank, _, _, heads in _plan(single, (0, 0), p)] == [
        ((0, 0), range(0, 1)),
        ((0, 2), range(1, 2)),
        ((1, 0), range(0, 1)),
        ((1, 2), range(1, 2)),
    ]


def test_handshake_is_cached_per_producer(pool):
    p = pool.get("kv_producer", 1, 1)
    with pool.engines({"engine_id": "cache-c", "tp": 1, "pp": 1, "role": "kv_consumer"}) as (c,):
        worker = c.workers[(0, 0)]
        for i in range(3):
            spec = LoadSpec.one_group(f"r{i}", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
            assert run_load(c, spec)[(0, 0)] == ({f"r{i}"}, set(), set())
        stats = worker.get_kv_connector_stats().data
    assert stats["num_handshakes"] == 1
    assert len(stats["handshake_ms"]) == 1
    assert stats["num_loads"] == 3
    assert stats["blocks_received"] == 3 * len(LOCAL_IDS)
    # 6 layers x 5 blocks x K/V x 2 heads x 8 tokens x 4 dims x 4 bytes.
    assert stats["bytes_received"] == 3 * 6 * 5 * 2 * 2 * 8 * 4 * 4
    assert len(stats["transfer_s"]) == 3


def test_the_steps_hooks_never_start_a_thread(pool, monkeypatch):
    """Starting a thread waits until it runs: on a core starved by other engines the
    watchdog caught vLLM's `start_load_kv` held 8.6 s inside ThreadPoolExecutor.submit
    (issue 34). More loads than loader threads, step by step: no hook starts a thread (the
    loaders started with the caches; pulls start theirs on the loader threads)."""
    p = pool.get("kv_producer", 1, 1)
    with pool.engines({"engine_id": "no-spawn", "tp": 1, "pp": 1, "role": "kv_consumer"}) as (c,):
        step = threading.current_thread()
        started_by_step: list[str] = []
        real_start = threading.Thread.start

        def recording_start(thread: threading.Thread) -> None:
            if threading.current_thread() is step:
                started_by_step.append(thread.name)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", recording_start)
        for i in range(6):
            spec = LoadSpec.one_group(f"n{i}", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
            assert run_load(c, spec)[(0, 0)] == ({f"n{i}"}, set(), set())
        assert started_by_step == []


def test_abort_while_pulling_writes_nothing_and_never_waits_on_the_step(pool):
    with pool.engines(
        {"engine_id": "stalled", "tp": 1, "pp": 1, "role": "kv_producer", "seed": SEED},
        {"engine_id": "abort-c", "tp": 1, "pp": 1, "role": "kv_consumer"},
    ) as (p, c):
        # The producer still answers handshakes but its agent no longer serves pulls.
        p.workers[(0, 0)].worker_half.agent.server.stop()
        worker = c.workers[(0, 0)]
        spec = LoadSpec.one_group("slow", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        worker.bind_connector_metadata(UcxConnectorMetadata(loads=(spec,)))
        worker.start_load_kv(None)
        wait_until(
            lambda: worker.worker_half.load_job("slow").num_pulls_started, "the pulls started"
        )
        assert worker.get_transfer_results(set()) == (None, None, None)
        # The step learns of the abort and goes on at once; the loader stops its pulls and the
        # load is reported then: failed (it delivered nothing), with no load errors (the
        # blocks are not its own any more) and no reason (nobody waits for that request).
        results = [worker.get_transfer_results({"slow"})]

        def reported() -> bool:
            results.append(worker.get_transfer_results(set()))
            return results[-1] != (None, None, None)

        if results[0] == (None, None, None):
            wait_until(reported, "the aborted load reported")
        assert [r for r in results if r != (None, None, None)] == [(None, {"slow"}, {"slow"})]
        assert worker.worker_half.load_job("slow") is None
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker.get_load_failure_reasons() == {}
        assert worker.get_transfer_results(set()) == (None, None, None)
        assert all(torch.all(cache == SENTINEL) for cache in c.caches[(0, 0)].values())
        assert worker.get_kv_connector_stats().data["num_loads_cancelled"] == 1


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FAILURES = {
    "block-out-of-range": (
        {},
        (99,),
        "ValueError: pull 'bad': remote block id 99 out of range for layer "
        "'model.layers.0.self_attn' with 24 blocks on the peer",
    ),
    "other-engine-id": (
        {"engine_id": "ghost"},
        REMOTE_IDS,
        "EngineIdMismatchError: expected engine 'ghost' at 127.0.0.1:\\d+, but engine "
        "'kv_producer-1x1' answered",
    ),
    "unreachable": (
        {"port": None},
        REMOTE_IDS,
        "ProducerUnreachable: engine 'kv_producer-1x1' at 127.0.0.1:\\d+ is gone: "
        "Connection refused",
    ),
    "stale-generation": (
        {"generation": 12345},
        REMOTE_IDS,
        "StaleGenerationError: engine 'kv_producer-1x1' at 127.0.0.1:\\d+ restarted or "
        "re-registered its KV cache \\(slept and woke up\\): it serves handshake generation "
        "\\d+, the request's KV was produced by generation 12345",
    ),
    "wrong-split": (
        {"tp_size": 2},
        REMOTE_IDS,
        "RemoteLayoutError: engine 'kv_producer-1x1' runs TP 1 x PP 1 but the request's "
        "kv_transfer_params say TP 2 x PP 1",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failed_load_reports_its_blocks(pool, caplog, case):
    changes, remote_ids, message = FAILURES[case]
    if changes.get("port", 0) is None:
        changes = {"port": _closed_port()}
    p = pool.get("kv_producer", 1, 1)
    c = pool.get("kv_consumer", 1, 1)
    local_ids = LOCAL_IDS[: len(remote_ids)]
    spec = LoadSpec.one_group("bad", p.remote("pre", remote_ids, **changes), remote_ids, local_ids)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
        results = run_load(c, spec)
    assert results == {(0, 0): ({"bad"}, {"bad"}, set(local_ids))}
    assert all(torch.all(cache == SENTINEL) for cache in c.caches[(0, 0)].values())
    (record,) = [r for r in caplog.records if "request bad" in r.getMessage()]
    assert record.getMessage().startswith(
        "loading KV of request bad from engine " + (changes.get("engine_id") or p.engine_id)
    )
    assert re.search(message, record.getMessage()), record.getMessage()


def test_block_size_mismatch_is_refused_at_handshake(pool, caplog):
    p = pool.get("kv_producer", 1, 1)
    with pool.engines(
        {"engine_id": "bs16", "tp": 1, "pp": 1, "role": "kv_consumer", "block_size": 16}
    ) as (c,):
        spec = LoadSpec.one_group("bs", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
            assert run_load(c, spec)[(0, 0)] == ({"bs"}, {"bs"}, set(LOCAL_IDS))
    assert (
        "HandshakeCompatibilityError: engine 'kv_producer-1x1' at " in caplog.text
        and "is incompatible with this engine: block_size: local=16 remote=8" in caplog.text
    )


@pytest.mark.parametrize(("producer", "consumer"), [((1, 1), (1, 1)), ((1, 1), (2, 1))])
def test_fp8_caches_load_through_the_handshake_byte_for_byte(pool, producer, consumer):
    # vLLM's fp8 caches are uint8 tensors with the format in the cache config: the producer
    # advertises its identity from the layout, the consumer checks it from its caches; both
    # must say "uint8:fp8_e4m3" (they once did not, and no fp8 cache ever loaded).
    fp8 = {"cache_dtype": "fp8_e4m3"}
    with pool.engines(
        {"engine_id": "fp8-p", "tp": producer[0], "pp": producer[1], "role": "kv_producer",
         "seed": SEED, **fp8},
        {"engine_id": "fp8-c", "tp": consumer[0], "pp": consumer[1], "role": "kv_consumer",
         **fp8},
    ) as (p, c):  # fmt: skip
        spec = LoadSpec.one_group("fp8", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        assert run_load(c, spec) == {rank: ({"fp8"}, set(), set()) for rank in c.workers}
        for rank, caches in c.caches.items():
            for name, cache in caches.items():
                expected = expected_rank_cache(
                    SEED, name, rank, c.tp_size, REMOTE_IDS, LOCAL_IDS, cache_dtype="fp8_e4m3"
                )
                assert cache.dtype == torch.uint8 and torch.equal(cache, expected), name


def test_two_fp8_formats_refuse_each_other_at_handshake(pool, caplog):
    with pool.engines(
        {"engine_id": "e4m3", "tp": 1, "pp": 1, "role": "kv_producer", "seed": SEED,
         "cache_dtype": "fp8_e4m3"},
        {"engine_id": "e5m2", "tp": 1, "pp": 1, "role": "kv_consumer",
         "cache_dtype": "fp8_e5m2"},
    ) as (p, c):  # fmt: skip
        spec = LoadSpec.one_group("fmt", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
            assert run_load(c, spec)[(0, 0)] == ({"fmt"}, {"fmt"}, set(LOCAL_IDS))
    assert "dtype: local='uint8:fp8_e5m2' remote='uint8:fp8_e4m3'" in caplog.text


def test_a_producer_without_drafter_cannot_feed_a_drafter(pool, caplog):
    with pool.engines(
        {
            "engine_id": "nodraft",
            "tp": 1,
            "pp": 1,
            "role": "kv_producer",
            "seed": SEED,
            "draft": False,
        }
    ) as (p,):
        c = pool.get("kv_consumer", 1, 1)
        spec = LoadSpec.one_group("d", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
            assert run_load(c, spec)[(0, 0)] == ({"d"}, {"d"}, set(LOCAL_IDS))
    assert "RemoteLayoutError: engine 'nodraft' holds no drafter layers; this worker does" in (
        caplog.text
    )


def test_failed_pull_drops_the_cached_handshake(pool):
    p = pool.get("kv_producer", 1, 1)
    with pool.engines({"engine_id": "retry-c", "tp": 1, "pp": 1, "role": "kv_consumer"}) as (c,):
        bad = LoadSpec.one_group("bad", p.remote("pre", (99,)), (99,), (0,))
        good = LoadSpec.one_group("good", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
        assert run_load(c, bad)[(0, 0)][1] == {"bad"}
        assert c.workers[(0, 0)].worker_half.remote_engines == []
        assert run_load(c, good)[(0, 0)] == ({"good"}, set(), set())
        assert c.workers[(0, 0)].get_kv_connector_stats().data["num_handshakes"] == 2
        _check_caches(c, REMOTE_IDS, LOCAL_IDS)


def test_empty_load_completes_without_a_handshake(pool):
    p = pool.get("kv_producer", 1, 1)
    with pool.engines({"engine_id": "empty-c", "tp": 1, "pp": 1, "role": "kv_consumer"}) as (c,):
        spec = LoadSpec.one_group("empty", p.remote("pre", ()), (), ())
        assert run_load(c, spec) == {(0, 0): ({"empty"}, set(), set())}
        assert c.workers[(0, 0)].worker_half.remote_engines == []


# The transport's default wait for a grant (`TransportConfig.grant_wait_s`): a producer's
# server parks a pull that long for its lease, a one-sided read once waited that long for its
# lease row.
GRANT_WAIT_S = 5.0


def test_a_lease_the_producers_workers_record_late_is_still_read(pool):
    """A lease not yet recorded is not a lease refused: the producer's scheduler lends the
    blocks (the params are out), but its busy workers record the grant only after more than
    the transport's grant wait. The load keeps asking, within its own deadline and while the
    producer is alive and still holds the request, and reads the right bytes."""
    p = pool.get("kv_producer", 1, 1)
    c = pool.get("kv_consumer", 1, 1)
    # In RMA mode the consumer then holds the producer's keys, so the one-sided check of the
    # lease row is what waits (a consumer without keys waits in its keys request instead).
    fine = LoadSpec.one_group("early", p.remote("early", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
    assert run_load(c, fine) == {(0, 0): ({"early"}, set(), set())}
    for cache in c.caches[(0, 0)].values():
        cache.fill_(SENTINEL)
    remote = p.remote("late-grant", REMOTE_IDS, grant=False)
    recorded = threading.Timer(
        GRANT_WAIT_S + 3.0, lambda: p.grant("late-grant", remote.secret, REMOTE_IDS)
    )
    recorded.start()
    try:
        spec = LoadSpec.one_group("late-grant", remote, REMOTE_IDS, LOCAL_IDS)
        assert run_load(c, spec) == {(0, 0): ({"late-grant"}, set(), set())}
        assert recorded.finished.is_set()
    finally:
        recorded.cancel()
        recorded.join()
    _check_caches(c, REMOTE_IDS, LOCAL_IDS)


def test_a_read_the_producer_no_longer_backs_fails(pool, caplog):
    p = pool.get("kv_producer", 1, 1)
    c = pool.get("kv_consumer", 1, 1)
    # A consumer that read from this producer before (in RMA mode: it holds its keys, so only
    # the one-sided lease check stands between it and the released blocks).
    fine = LoadSpec.one_group("fine", p.remote("held", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
    assert run_load(c, fine) == {(0, 0): ({"fine"}, set(), set())}
    for cache in c.caches[(0, 0)].values():
        cache.fill_(SENTINEL)
    remote = p.remote("expired", REMOTE_IDS)
    leases = p.scheduler.scheduler_half.leases
    leases.finish([("expired", 0, remote.secret)])
    # The producer let go of the blocks before the consumer read them: its workers' grant ends.
    p.step(releases=tuple(leases.take()))
    spec = LoadSpec.one_group("late", remote, REMOTE_IDS, LOCAL_IDS)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.connectors.ucx.worker"):
        assert run_load(c, spec) == {(0, 0): ({"late"}, {"late"}, set(LOCAL_IDS))}
    if pool.data_plane in ("tagged", "push"):
        # The producer refuses the read (or the ask to push) itself.
        asked = "push ask request" if pool.data_plane == "push" else "pull 'late'"
        assert f"{asked} refused by" in caplog.text
        assert (
            "(ACCESS_DENIED): lease 'expired' has ended (its consumer released it): its KV "
            "cannot be read" in caplog.text
        )
    else:
        # No row for the lease in the producer's table, and the liveness probe's "still
        # held?" says no: the read never starts.
        assert (
            "LeaseLostError: engine 'kv_producer-1x1' no longer holds request 'expired'"
            in caplog.text
        )
    assert all(torch.all(cache == SENTINEL) for cache in c.caches[(0, 0)].values())
