"""The vLLM adapter under pipeline parallelism, and its start-up answers, with look-alikes of
vLLM 0.32's objects (vLLM not imported).

A vLLM PP engine gives each worker only its stage's attention layers (``get_pp_indices``: the
remainder goes to the stages before the last, not to the first ones as in our engine) and keys
worker handshakes ``(pp_rank, tp_rank)``. Checked here, from the adapter's translations to the
hosted UcxConnector's plans: each worker's `KVCacheLayout` (its rank, the whole model's layer
count), the exact layers each stage's views register, the ``(pp, tp)``-keyed handshakes the
scheduler half accepts, and the exact (remote rank, layers, heads) every consumer worker pulls
between differently split engines. Also `check_deployment` (host staging and context
parallelism refused) and `needs_piecewise_cudagraph`. The adapter class itself (its rank
lookup, its forwarding of the merged handshakes) needs vLLM: ``vllm_stage/check_adapter_pp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kvtransfer.connector.metadata import KVCacheLayout, PpTpRank
from kvtransfer.connectors.ucx.identity import WorkerIdentity
from kvtransfer.connectors.ucx.metadata import UcxHandshakeMetadata
from kvtransfer.connectors.ucx.plan import LocalTopologies, PlannedPull, plan_pulls
from kvtransfer.connectors.ucx.scheduler import EngineSplit, engine_split
from kvtransfer.integrations.vllm_translate import (
    check_deployment,
    needs_piecewise_cudagraph,
    vllm_kv_cache_layout,
    vllm_kv_views,
)

pytestmark = pytest.mark.unit

NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 8, 16, 6
AGENT = "YWdlbnQ="  # base64 of an agent address; never dialled here

# ---------------------------------------------------------------------------------------------
# Look-alikes of vLLM's objects (attributes only, as vLLM 0.32 spells them).


def vllm_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM 0.32's ``vllm.distributed.utils.get_pp_indices`` without its env override: the
    remainder goes one layer each to the stages just before the last."""
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def test_the_look_alike_splits_layers_as_vllm_does():
    # Pinned from vLLM 0.32's rule; ours (kvtransfer.engine.parallel) gives 7 over 3 as 3/2/2.
    assert [vllm_pp_indices(4, p, 2) for p in range(2)] == [(0, 2), (2, 4)]
    assert [vllm_pp_indices(7, p, 3) for p in range(3)] == [(0, 2), (2, 5), (5, 7)]
    assert [vllm_pp_indices(7, p, 2) for p in range(2)] == [(0, 4), (4, 7)]


@dataclass
class FakeModelConfig:
    num_layers: int
    model: str = "tiny-llama"
    dtype: torch.dtype = torch.float32

    def get_total_num_hidden_layers(self) -> int:
        return self.num_layers

    def get_total_num_kv_heads(self) -> int:
        return NUM_KV_HEADS

    def get_head_size(self) -> int:
        return HEAD_SIZE


def vllm_config(num_layers: int, tp: int, pp: int, **overrides) -> SimpleNamespace:
    kv = {"kv_buffer_device": "cuda", **overrides.pop("kv", {})}
    parallel = {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "prefill_context_parallel_size": 1,
        "decode_context_parallel_size": 1,
        **overrides.pop("parallel", {}),
    }
    return SimpleNamespace(
        model_config=FakeModelConfig(num_layers),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
        parallel_config=SimpleNamespace(**parallel),
        kv_transfer_config=SimpleNamespace(**kv),
        device_config=SimpleNamespace(device_type=overrides.pop("device_type", "cuda")),
    )


def layer_names(num_layers: int, pp_rank: int, pp_size: int) -> list[str]:
    """The attention layers a vLLM worker of stage ``pp_rank`` registers."""
    start, end = vllm_pp_indices(num_layers, pp_rank, pp_size)
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]


def worker_kv_cache_config(names: list[str]) -> SimpleNamespace:
    """A worker's ``KVCacheConfig``: vLLM projects the one group onto the worker's layers."""
    spec = type("FullAttentionSpec", (), {"dtype": torch.float32})()
    group = SimpleNamespace(layer_names=names, kv_cache_spec=spec)
    return SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group])


def vllm_worker_caches(names: list[str], heads: int) -> dict[str, torch.Tensor]:
    """A GPU-style (last-axis [K | V]) 4-D view per layer, all layers in one buffer."""
    buffer = torch.zeros(len(names), NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE)
    return {name: buffer[i] for i, name in enumerate(names)}


@dataclass(frozen=True)
class Engine:
    tp: int
    pp: int
    identities: dict[PpTpRank, WorkerIdentity]

    def handshakes(self) -> dict[PpTpRank, UcxHandshakeMetadata]:
        """As vLLM's engine core merges them: one ``{(pp, tp): md}`` per worker, ``update``d."""
        merged: dict[PpTpRank, UcxHandshakeMetadata] = {}
        for rank, identity in self.identities.items():
            merged.update({rank: identity.handshake(AGENT)})
        return merged


def vllm_engine(engine_id: str, num_layers: int, tp: int, pp: int) -> Engine:
    """Every worker of a vLLM engine as the adapter sets it up: its layout from vLLM's config and
    its own kv_cache_config, its caches viewed by `vllm_kv_views`, the hosted connector's
    identity built from them."""
    config = vllm_config(num_layers, tp, pp)
    identities = {}
    for p in range(pp):
        names = layer_names(num_layers, p, pp)
        for t in range(tp):
            layout = vllm_kv_cache_layout(config, worker_kv_cache_config(names), (p, t))
            views = vllm_kv_views(vllm_worker_caches(names, NUM_KV_HEADS // tp), layout)
            identities[(p, t)] = WorkerIdentity.from_caches(engine_id, layout, views)
    return Engine(tp, pp, identities)


# ---------------------------------------------------------------------------------------------
# Layouts and layers per PP rank


def test_every_worker_of_a_pp2_tp2_engine_gets_its_rank_and_the_whole_model():
    config = vllm_config(num_layers=4, tp=2, pp=2)
    for p in range(2):
        kv_cache_config = worker_kv_cache_config(layer_names(4, p, 2))
        for t in range(2):
            assert vllm_kv_cache_layout(config, kv_cache_config, (p, t)) == KVCacheLayout(
                model="tiny-llama",
                dtype="float32",
                block_size=BLOCK_SIZE,
                num_blocks=NUM_BLOCKS,
                # The whole model's: both engines compare it, however each is split.
                num_layers=4,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_SIZE,
                tp_size=2,
                pp_size=2,
                pp_rank=p,
                tp_rank=t,
                kv_order="B2HND",
                # vLLM's null block (one group: never in a request's list, but named).
                null_block_id=0,
            )
    scheduler = vllm_kv_cache_layout(config, worker_kv_cache_config(layer_names(4, 0, 2)), None)
    assert (scheduler.rank, scheduler.pp_size, scheduler.tp_size) == (None, 2, 2)


def test_each_pp_stage_registers_exactly_its_layers_and_heads():
    engine = vllm_engine("prefill", num_layers=7, tp=2, pp=3)
    layers = {
        rank: [(la.name, la.index, la.num_kv_heads) for la in identity.target_layers()]
        for rank, identity in engine.identities.items()
    }
    stage = {
        0: [(f"model.layers.{i}.self_attn.attn", i, 2) for i in (0, 1)],
        1: [(f"model.layers.{i}.self_attn.attn", i, 2) for i in (2, 3, 4)],
        2: [(f"model.layers.{i}.self_attn.attn", i, 2) for i in (5, 6)],
    }
    assert layers == {(p, t): stage[p] for p in range(3) for t in range(2)}
    for (p, t), identity in engine.identities.items():
        assert (identity.pp_rank, identity.tp_rank, identity.pp_size) == (p, t, 3)
        assert identity.num_layers == 7
        assert identity.kv_heads == range(2 * t, 2 * t + 2)


def test_the_scheduler_half_accepts_the_pp_keyed_handshakes_vllm_merges():
    engine = vllm_engine("prefill", num_layers=4, tp=2, pp=2)
    handshakes = engine.handshakes()
    assert sorted(handshakes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {rank: (md.pp_rank, md.tp_rank) for rank, md in handshakes.items()} == {
        rank: rank for rank in handshakes
    }
    assert engine_split("prefill", handshakes) == EngineSplit(2, 2, BLOCK_SIZE)
    # A stage missing (vLLM's base class would have refused pp_rank 1 outright) is refused.
    without_stage_1 = {rank: md for rank, md in handshakes.items() if rank[0] == 0}
    with pytest.raises(ValueError, match=r"TP 2 x PP 2 needs \[\(0, 0\), \(0, 1\), \(1, 0\)"):
        engine_split("prefill", without_stage_1)


# ---------------------------------------------------------------------------------------------
# What every consumer worker pulls, and from which producer rank


def pulls(consumer: Engine, producer: Engine) -> dict[PpTpRank, list[tuple]]:
    planned: dict[PpTpRank, list[PlannedPull]] = {}
    for rank, identity in consumer.identities.items():
        planned[rank] = plan_pulls(
            identity, LocalTopologies.of(identity), "prefill", producer.handshakes()
        )
    return {
        rank: [
            (p.remote_rank, [int(n.split(".")[2]) for n in p.layer_names], p.remote_heads,
             p.local_heads)
            for p in plans
        ]
        for rank, plans in planned.items()
    }  # fmt: skip


def test_a_pp1_decode_pulls_each_layer_from_the_pp_stage_holding_it():
    producer = vllm_engine("prefill", num_layers=4, tp=1, pp=2)
    consumer = vllm_engine("decode", num_layers=4, tp=1, pp=1)
    every = range(0, NUM_KV_HEADS)
    assert pulls(consumer, producer) == {
        (0, 0): [((0, 0), [0, 1], every, every), ((1, 0), [2, 3], every, every)],
    }


def test_differently_split_pp_engines_pull_across_stage_boundaries():
    # vLLM's splits: 7 layers over 3 stages (2/3/2) feeding 2 stages (4/3).
    producer = vllm_engine("prefill", num_layers=7, tp=1, pp=3)
    consumer = vllm_engine("decode", num_layers=7, tp=1, pp=2)
    every = range(0, NUM_KV_HEADS)
    assert pulls(consumer, producer) == {
        (0, 0): [((0, 0), [0, 1], every, every), ((1, 0), [2, 3], every, every)],
        (1, 0): [((1, 0), [4], every, every), ((2, 0), [5, 6], every, every)],
    }


def test_a_tp2_pp2_prefill_feeds_a_tp1_pp1_decode_head_slice_by_head_slice():
    producer = vllm_engine("prefill", num_layers=4, tp=2, pp=2)
    consumer = vllm_engine("decode", num_layers=4, tp=1, pp=1)
    low, high = range(0, 2), range(2, 4)
    assert pulls(consumer, producer) == {
        (0, 0): [
            ((0, 0), [0, 1], low, low),
            ((0, 1), [0, 1], low, high),
            ((1, 0), [2, 3], low, low),
            ((1, 1), [2, 3], low, high),
        ],
    }


def test_a_pp1_prefill_feeds_each_stage_of_a_pp2_decode_its_layers():
    producer = vllm_engine("prefill", num_layers=4, tp=1, pp=1)
    consumer = vllm_engine("decode", num_layers=4, tp=2, pp=2)
    low, high, mine = range(0, 2), range(2, 4), range(0, 2)
    assert pulls(consumer, producer) == {
        (0, 0): [((0, 0), [0, 1], low, mine)],
        (0, 1): [((0, 0), [0, 1], high, mine)],
        (1, 0): [((0, 0), [2, 3], low, mine)],
        (1, 1): [((0, 0), [2, 3], high, mine)],
    }


# ---------------------------------------------------------------------------------------------
# check_deployment


@pytest.mark.parametrize(
    ("buffer", "device"), [("cuda", "cuda"), ("cpu", "cpu"), ("cuda", "cpu"), ("xpu", "xpu")]
)
def test_device_buffers_and_cpu_engines_are_served(buffer, device):
    check_deployment(vllm_config(4, 1, 1, kv={"kv_buffer_device": buffer}, device_type=device))


@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_host_staging_of_accelerator_caches_is_refused_naming_the_limit(device):
    config = vllm_config(4, 1, 1, kv={"kv_buffer_device": "cpu"}, device_type=device)
    with pytest.raises(
        ValueError,
        match=rf"kv_buffer_device 'cpu' .* not supported .*caches are on {device} .*set "
        rf"kv_buffer_device to '{device}'",
    ):
        check_deployment(config)


@pytest.mark.parametrize(("pcp", "dcp"), [(2, 1), (1, 2), (2, 2)])
def test_context_parallelism_is_refused(pcp, dcp):
    config = vllm_config(
        4,
        2,
        1,
        parallel={"prefill_context_parallel_size": pcp, "decode_context_parallel_size": dcp},
    )
    with pytest.raises(ValueError, match=rf"context parallelism \(prefill {pcp}, decode {dcp}\)"):
        check_deployment(config)


# ---------------------------------------------------------------------------------------------
# needs_piecewise_cudagraph

UCX = {"kv_connector": "UcxConnector"}
STORAGE = {
    "kv_connector": "SharedStorageConnector",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"},
}
THIRD_PARTY = {"kv_connector": "LayerwiseConnector"}


@pytest.mark.parametrize(
    ("name", "extra", "piecewise"),
    [
        ("UcxConnector", {}, False),
        ("SharedStorageConnector", {"shared_storage_path": "/tmp/kv"}, False),
        ("LayerwiseConnector", {}, True),
        (None, {}, True),
        ("MultiConnector", {"connectors": [UCX, STORAGE]}, False),
        ("MultiConnector", {"connectors": [UCX, THIRD_PARTY]}, True),
        (
            "MultiConnector",
            {"connectors": [{"kv_connector": "MultiConnector",
                             "kv_connector_extra_config": {"connectors": [STORAGE, UCX]}}]},
            False,
        ),
        ("MultiConnector", {"connectors": []}, True),
        ("MultiConnector", {"connectors": ["UcxConnector"]}, True),
        ("MultiConnector", {}, True),
    ],
    ids=[
        "ucx", "storage", "third-party", "unnamed", "multi", "multi-third-party", "nested",
        "multi-empty", "multi-malformed", "multi-unconfigured",
    ],
)  # fmt: skip
def test_full_cuda_graphs_only_for_connectors_without_layer_hooks(name, extra, piecewise):
    assert needs_piecewise_cudagraph(name, extra) is piecewise
