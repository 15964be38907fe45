"""The worker half of `SharedStorageConnector` without an engine: files written by producer
workers of any TP x PP split are read back, byte for byte, by consumer workers of any other
split; broken, missing or foreign files fail the load and flag exactly the blocks it writes."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
import torch
from shared_storage_helpers.engines import read_file
from waiting import wait_until

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connectors.shared_storage.metadata import (
    LoadSpec,
    SaveSpec,
    SharedStorageConnectorMetadata,
)
from kvtransfer.connectors.shared_storage.storage import SharedStorageConfig
from kvtransfer.connectors.shared_storage.worker import SharedStorageWorker
from kvtransfer.engine.parallel import pp_layer_range
from kvtransfer.testing import make_kv_caches

pytestmark = pytest.mark.unit

NUM_LAYERS = 4
NUM_HEADS = 4
BLOCK = 4
TOKENS = tuple(range(100, 110))  # 10 tokens: 3 blocks, the last one partial
PRODUCER_BLOCKS = (6, 1, 4)
CONSUMER_BLOCKS = (2, 7, 0)


def full_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    caches = make_kv_caches(
        num_layers=NUM_LAYERS, num_blocks=8, num_kv_heads=NUM_HEADS, block_size=BLOCK, head_dim=2
    )
    caches["draft.layers.0.self_attn"] = torch.randn(
        8, 2, NUM_HEADS, BLOCK, 2, generator=torch.Generator().manual_seed(seed)
    )
    return {name: cache + seed * 1000 for name, cache in caches.items()}


def shard(caches: dict[str, torch.Tensor], tp: int, pp: int, tp_rank: int, pp_rank: int):
    """What worker (pp_rank, tp_rank) of a TPxPP engine holds; the drafter lives on the last
    stage, TP-sharded like the target."""
    start, end = pp_layer_range(NUM_LAYERS, pp, pp_rank)
    heads = NUM_HEADS // tp
    names = [f"model.layers.{i}.self_attn" for i in range(start, end)]
    if pp_rank == pp - 1:
        names.append("draft.layers.0.self_attn")
    return {n: caches[n][:, :, tp_rank * heads : (tp_rank + 1) * heads].clone() for n in names}


def make_worker(root, caches, global_rank=0, engine_id="engine", **extra) -> SharedStorageWorker:
    config = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={"shared_storage_path": str(root), **extra},
    )
    worker = SharedStorageWorker(
        config, SharedStorageConfig.from_transfer_config(config), global_rank
    )
    worker.register_kv_caches(caches)
    return worker


def wait_for(worker: SharedStorageWorker, finished: Iterable[str] = ()):
    """Poll until the worker reports something; returns (sending, recving, failed)."""

    def reported():
        sending, recving, failed = worker.transfer_results(finished)
        return (sending, recving, failed) if sending or recving else None

    return wait_until(reported, "the worker reports a finished transfer", 20, interval=0.005)


def save(root, caches, tp=1, pp=1, token_ids=TOKENS, req_id="req"):
    """Every producer worker saves ``req_id``; returns the request's directory."""
    directory = root / "engine" / req_id
    spec = SaveSpec(req_id, str(directory), PRODUCER_BLOCKS, tuple(token_ids))
    metadata = SharedStorageConnectorMetadata(tp_size=tp, pp_size=pp, saves=(spec,))
    for p in range(pp):
        for t in range(tp):
            worker = make_worker(root, shard(caches, tp, pp, t, p), global_rank=p * tp + t)
            worker.start_load_kv(metadata)
            assert wait_for(worker) == ({req_id}, None, None)
            assert worker.stats().data["num_saves"] == 1
            worker.shutdown()
    return directory


def load_spec(directory, tp=1, pp=1, start=0, token_ids=TOKENS, blocks=CONSUMER_BLOCKS):
    return LoadSpec("dec", str(directory), tp, pp, blocks, start, tuple(token_ids))


def load(worker, spec, tp=1, pp=1):
    worker.start_load_kv(SharedStorageConnectorMetadata(tp_size=tp, pp_size=pp, loads=(spec,)))
    return wait_for(worker)


SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


@pytest.mark.parametrize("producer", SPLITS, ids=lambda s: f"producer-tp{s[0]}pp{s[1]}")
@pytest.mark.parametrize("consumer", [(1, 1), (2, 2), (4, 1)], ids=lambda s: f"tp{s[0]}pp{s[1]}")
def test_any_split_reads_what_any_split_wrote(tmp_path, producer, consumer):
    source = full_caches()
    directory = save(tmp_path, source, *producer)
    files = sorted(p.name for p in directory.iterdir())
    ptp, ppp = producer
    assert files == sorted(f"pp{p}_tp{t}.safetensors" for p in range(ppp) for t in range(ptp))
    tp, pp = consumer
    spec = load_spec(directory, ptp, ppp)
    for p in range(pp):
        for t in range(tp):
            before = shard(full_caches(seed=1), tp, pp, t, p)
            caches = {name: cache.clone() for name, cache in before.items()}
            worker = make_worker(tmp_path, caches, global_rank=p * tp + t)
            assert load(worker, spec, tp, pp) == (None, {"dec"}, None)
            expected = shard(source, tp, pp, t, p)
            for name, cache in caches.items():
                dst, src = list(CONSUMER_BLOCKS), list(PRODUCER_BLOCKS)
                assert torch.equal(cache[dst], expected[name][src]), name
                untouched = [b for b in range(8) if b not in dst]
                assert torch.equal(cache[untouched], before[name][untouched]), name
            loaded = sum(c[dst].numel() * c.element_size() for c in caches.values())
            assert worker.stats().data == {"num_loads": 1, "bytes_loaded": loaded}
            worker.shutdown()


def test_local_prefix_blocks_are_not_overwritten(tmp_path):
    source = full_caches()
    directory = save(tmp_path, source)
    caches = full_caches(seed=1)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker = make_worker(tmp_path, caches)
    # Tokens [0, 4) were a local prefix-cache hit in block 2.
    assert load(worker, load_spec(directory, start=BLOCK)) == (None, {"dec"}, None)
    for name, cache in caches.items():
        assert torch.equal(cache[2], before[name][2])
        assert torch.equal(cache[[7, 0]], source[name][[1, 4]])
    worker.shutdown()


def test_file_records_heads_layers_and_tokens(tmp_path):
    directory = save(tmp_path, full_caches(), tp=2, pp=2)
    metadata, tensors = read_file(directory / "pp1_tp1.safetensors")
    assert metadata == {
        "format": "kvtransfer.shared_storage.v1",
        "engine_id": "engine",
        "request_id": "req",
        "dtype": "float32",
        "layers": '{"model.layers.2.self_attn": [2, 4, 4], "model.layers.3.self_attn": '
        '[2, 4, 4], "draft.layers.0.self_attn": [2, 4, 4]}',
        "num_tokens": "10",
        "block_size": "4",
        "pp_rank": "1",
        "tp_rank": "1",
        "pp_size": "2",
        "tp_size": "2",
    }
    assert tensors["__token_ids__"].tolist() == list(TOKENS)
    assert tensors["model.layers.2.self_attn"].shape == (3, 2, 2, BLOCK, 2)
    assert not list(directory.glob(".*.tmp"))


# ------------------------------------------------------------------------------ failures


def corrupt(directory):
    (directory / "pp0_tp0.safetensors").write_bytes(b"not a safetensors file")


def truncate(directory):
    path = directory / "pp0_tp0.safetensors"
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize(
    ("break_files", "spec_change", "message"),
    [
        (corrupt, {}, "cannot read pp0_tp0.safetensors: .*header"),
        (truncate, {}, "cannot read pp0_tp0.safetensors: .*incomplete metadata"),
        (None, {"token_ids": (1, *TOKENS[1:])}, "holds KV of different tokens"),
        (None, {"token_ids": (*TOKENS, 1)}, "pp0_tp0.safetensors holds 10 tokens, 11 are needed"),
        (None, {"tp": 2}, r"did not appear in .* within 0\.2 s"),
    ],
    ids=["corrupt", "truncated", "other-prompt", "too-short", "missing"],
)
def test_bad_files_fail_the_load_and_flag_its_blocks(
    tmp_path, caplog, break_files, spec_change, message
):
    directory = save(tmp_path, full_caches())
    if break_files is not None:
        break_files(directory)
    change = dict(spec_change)
    spec = load_spec(directory, tp=change.pop("tp", 1), start=BLOCK, **change)
    caches = full_caches(seed=1)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker = make_worker(tmp_path, caches, load_timeout_s=0.2)
    assert load(worker, spec) == (None, {"dec"}, {"dec"})
    assert worker.block_ids_with_load_errors() == set(spec.block_ids[1:3])
    assert worker.block_ids_with_load_errors() == set()  # drained by the call
    assert worker.stats().data == {"num_loads_failed": 1}
    assert any(
        "loading KV of request dec failed" in r.message and re.search(message, r.message)
        for r in caplog.records
    ), [r.message for r in caplog.records]
    for name, cache in caches.items():
        assert torch.equal(cache, before[name])
    worker.shutdown()


@pytest.mark.parametrize(
    ("consumer", "message"),
    [
        ({"block_size": 8}, "block_size is 4, expected 8"),
        ({"dtype": torch.float64}, "dtype is 'float32', expected 'float64'"),
        ({"tp": 8}, r"the producer split it into 4 KV heads, this worker into 8"),
        ({"drop": "draft.layers.0.self_attn"}, r"no producer file holds layer 'draft\.layers"),
    ],
)
def test_mismatched_layouts_fail_the_load(tmp_path, caplog, consumer, message):
    source = full_caches()
    if "drop" in consumer:
        source.pop(consumer["drop"])
        directory = tmp_path / "engine" / "req"
        spec = SaveSpec("req", str(directory), PRODUCER_BLOCKS, TOKENS)
        names = [n for n in source if n.startswith("model.")]
        worker = make_worker(tmp_path, {n: source[n] for n in names})
        worker.start_load_kv(SharedStorageConnectorMetadata(tp_size=1, pp_size=1, saves=(spec,)))
        wait_for(worker)
    else:
        directory = save(tmp_path, source)
    caches = full_caches(seed=1)
    if "block_size" in consumer:
        caches = {n: c.reshape(4, 2, NUM_HEADS, 8, 2) for n, c in caches.items()}
    if "dtype" in consumer:
        caches = {n: c.to(consumer["dtype"]) for n, c in caches.items()}
    tp = 1
    if "tp" in consumer:
        # 8 ranks of a 4-head model each hold one (replicated) head.
        tp = consumer["tp"]
        caches = {n: c[:, :, :1].clone() for n, c in caches.items()}
    worker = make_worker(tmp_path, caches, load_timeout_s=0.2)
    blocks = CONSUMER_BLOCKS if "block_size" not in consumer else (2, 3)
    assert load(worker, load_spec(directory, blocks=blocks), tp=tp) == (None, {"dec"}, {"dec"})
    assert any(re.search(message, r.message) for r in caplog.records), [
        r.message for r in caplog.records
    ]
    worker.shutdown()


def test_request_holding_too_few_blocks_fails(tmp_path):
    worker = make_worker(tmp_path, full_caches())
    spec = load_spec(tmp_path / "engine" / "req", blocks=(1, 2))
    assert load(worker, spec) == (None, {"dec"}, {"dec"})
    assert worker.block_ids_with_load_errors() == {1, 2}
    saver = make_worker(tmp_path, full_caches())
    short = SaveSpec("req", str(tmp_path / "x"), (1,), TOKENS)
    saver.start_load_kv(SharedStorageConnectorMetadata(tp_size=1, pp_size=1, saves=(short,)))
    # A failed save still ends the borrow (the consumer's load will fail on its own).
    assert wait_for(saver) == ({"req"}, None, None)
    assert saver.stats().data == {"num_saves_failed": 1}
    assert not (tmp_path / "x").exists()


def test_steps_without_layout_fail_loads_and_end_saves(tmp_path):
    worker = make_worker(tmp_path, full_caches())
    metadata = SharedStorageConnectorMetadata(
        saves=(SaveSpec("s", str(tmp_path / "s"), (1, 2, 3), TOKENS),),
        loads=(load_spec(tmp_path / "nothing"),),
    )
    worker.start_load_kv(metadata)
    assert worker.transfer_results(set()) == ({"s"}, {"dec"}, {"dec"})
    assert worker.block_ids_with_load_errors() == set(CONSUMER_BLOCKS)


def test_load_waits_for_files_written_later(tmp_path):
    caches = full_caches(seed=1)
    worker = make_worker(tmp_path, caches, load_timeout_s=30)
    directory = tmp_path / "engine" / "req"
    worker.start_load_kv(
        SharedStorageConnectorMetadata(tp_size=1, pp_size=1, loads=(load_spec(directory),))
    )
    assert worker.transfer_results(set()) == (None, None, None)
    source = full_caches()
    save(tmp_path, source)
    assert wait_for(worker) == (None, {"dec"}, None)
    name = "model.layers.0.self_attn"
    assert torch.equal(caches[name][list(CONSUMER_BLOCKS)], source[name][list(PRODUCER_BLOCKS)])
    worker.shutdown()


def test_finishing_request_cancels_its_waiting_load(tmp_path):
    caches = full_caches(seed=1)
    before = {name: cache.clone() for name, cache in caches.items()}
    worker = make_worker(tmp_path, caches, load_timeout_s=60)
    spec = load_spec(tmp_path / "engine" / "req")
    worker.start_load_kv(SharedStorageConnectorMetadata(tp_size=1, pp_size=1, loads=(spec,)))
    # The cancellation is noticed after this call, so it cannot report in the same one.
    assert worker.transfer_results({"dec"}) == (None, None, None)
    assert wait_for(worker) == (None, {"dec"}, None)
    assert worker.block_ids_with_load_errors() == set()
    assert worker.stats().data == {"num_loads_cancelled": 1}
    for name, cache in caches.items():
        assert torch.equal(cache, before[name])
    worker.shutdown()


def test_shutdown_stops_waiting_loads_and_is_idempotent(tmp_path):
    worker = make_worker(tmp_path, full_caches(), load_timeout_s=60)
    worker.start_load_kv(
        SharedStorageConnectorMetadata(tp_size=1, pp_size=1, loads=(load_spec(tmp_path / "never"),))
    )
    worker.shutdown()
    worker.shutdown()
    assert worker.transfer_results(set()) == (None, {"dec"}, None)
    with pytest.raises(RuntimeError, match="worker is shut down"):
        worker.start_load_kv(
            SharedStorageConnectorMetadata(tp_size=1, pp_size=1, loads=(load_spec(tmp_path),))
        )


def test_register_refuses_caches_of_another_layout(tmp_path):
    with pytest.raises(
        ValueError, match=r"KV cache 'a': a KV cache in order 'B2HND' must have 5 axes with 2 at"
    ):
        make_worker(tmp_path, {"a": torch.zeros(4, 3, 2, 4, 2)})
    with pytest.raises(ValueError, match="'b' differs from the others"):
        make_worker(tmp_path, {"a": torch.zeros(4, 2, 2, 4, 2), "b": torch.zeros(5, 2, 2, 4, 2)})
