"""Sparse MLA (DeepSeek-V3.2, GLM-5) through `UcxConnector`, over real UCX: every layer holds
an MLA latent (bfloat16, 576 per token) and its lightning indexer's k-cache, a vLLM layer of its
own (uint8, 132 bytes of keys and scales per token), both one vector per token, the same on
every TP rank, in one block table.

Synthetic engines as in ``ucx_helpers/synthetic.py``, over caches shaped as vLLM hands them to
the adapter (``[blocks, 1, block_size, C]`` per layer) and viewed by the adapter's own
`vllm_kv_views`: a consumer loads a scattered set of blocks of every layer, latent and indexer,
byte for byte on both data planes and across TP and PP sizes; an indexer of another width or
dtype fails the load naming the layer and both widths, and writes nothing.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from ucx_helpers.synthetic import BLOCK_SIZE, NUM_BLOCKS, SyntheticEngine, run_load

from kvtransfer.connector.config import KVTransferConfig
from kvtransfer.connector.metadata import (
    KVCacheLayout,
    KVConnectorRole,
    LayerWidth,
    merge_handshake_metadata,
)
from kvtransfer.connectors.ucx import LoadSpec, UcxConnector
from kvtransfer.connectors.ucx.identity import WorkerIdentity
from kvtransfer.engine.parallel import pp_layer_range
from kvtransfer.integrations.vllm_translate import vllm_kv_views

pytestmark = pytest.mark.integration

SEED = 23
NUM_LAYERS = 4
LATENT = (576, torch.bfloat16)  # elements per token, dtype
INDEXER = (132, torch.uint8)  # 128 fp8 keys and one fp32 scale per 128, as bytes
SENTINEL = {torch.bfloat16: -7.0, torch.uint8: 0xA5, torch.float16: -7.0}
# Scattered and unsorted, remote != local; the other local blocks are never written.
REMOTE_IDS = (5, 17, 2, 9, 23)
LOCAL_IDS = (0, 11, 3, 20, 4)


def latent_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer_name(i: int) -> str:
    # As vLLM's DeepseekV32IndexerCache names it (deepseek_v2.py: f"{prefix}.k_cache").
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def layout(
    tp: int, pp: int, rank: tuple[int, int] | None, indexer: tuple[int, torch.dtype]
) -> KVCacheLayout:
    """What the adapter's `vllm_kv_cache_layout` says for such an engine: one replicated
    "head" of the latent's halves, and each indexer's own width."""
    width, dtype = indexer
    return KVCacheLayout(
        model="synthetic-sparse-mla",
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        num_layers=NUM_LAYERS,
        num_kv_heads=1,
        head_dim=LATENT[0] // 2,
        tp_size=tp,
        pp_size=pp,
        pp_rank=None if rank is None else rank[0],
        tp_rank=None if rank is None else rank[1],
        layer_widths=tuple(
            LayerWidth(indexer_name(i), width // 2, str(dtype).removeprefix("torch."))
            for i in range(NUM_LAYERS)
        ),
    )


def produced(name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A producer layer's whole cache, as vLLM hands it: [blocks, 1, block_size, width]."""
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
    shape = (NUM_BLOCKS, 1, BLOCK_SIZE, width)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=generator, dtype=dtype)
    return torch.randn(*shape, generator=generator).to(dtype)


def rank_caches(
    pp: int, rank: tuple[int, int], producer: bool, indexer: tuple[int, torch.dtype]
) -> dict[str, torch.Tensor]:
    """One rank's layers: its PP stage's latents and indexers, the same on every TP rank."""
    start, end = pp_layer_range(NUM_LAYERS, pp, rank[0])
    caches = {}
    for i in range(start, end):
        for name, (width, dtype) in ((latent_name(i), LATENT), (indexer_name(i), indexer)):
            if producer:
                caches[name] = produced(name, width, dtype)
            else:
                caches[name] = torch.full(
                    (NUM_BLOCKS, 1, BLOCK_SIZE, width), SENTINEL[dtype], dtype=dtype
                )
    return caches


def start(
    engine_id: str,
    tp: int,
    pp: int,
    role: str,
    plane: str,
    indexer: tuple[int, torch.dtype] = INDEXER,
) -> SyntheticEngine:
    """A synthetic engine whose workers register the adapter's views of vLLM-shaped caches
    (``engine.caches``: the vLLM-shaped tensors)."""
    config = KVTransferConfig(
        kv_connector="UcxConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={"data_plane": plane},
    )
    scheduler = UcxConnector(config, KVConnectorRole.SCHEDULER, layout(tp, pp, None, indexer))
    engine = SyntheticEngine(engine_id, tp, pp, scheduler, {}, {})
    try:
        for p in range(pp):
            for t in range(tp):
                ours = layout(tp, pp, (p, t), indexer)
                worker = UcxConnector(config, KVConnectorRole.WORKER, ours)
                engine.workers[(p, t)] = worker
                native = rank_caches(pp, (p, t), role == "kv_producer", indexer)
                engine.caches[(p, t)] = native
                # MLA caches: split on the last axis whatever the backend (as the adapter).
                worker.register_kv_caches(vllm_kv_views(native, ours, "last_axis"))
        merged = merge_handshake_metadata(
            [{rank: w.get_handshake_metadata()} for rank, w in engine.workers.items()]
        )
        scheduler.set_xfer_handshake_metadata_pp_aware(merged)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def expected(name: str, consumer: torch.Tensor) -> torch.Tensor:
    want = torch.full_like(consumer, SENTINEL[consumer.dtype])
    want[list(LOCAL_IDS)] = produced(name, consumer.shape[-1], consumer.dtype)[list(REMOTE_IDS)]
    return want


@pytest.mark.parametrize("plane", ["rma", "tagged"])
@pytest.mark.parametrize(
    ("producer", "consumer"),
    [((1, 1), (2, 1)), ((2, 2), (1, 1))],
    ids=lambda s: f"tp{s[0]}pp{s[1]}",
)
def test_latents_and_indexer_caches_arrive_byte_for_byte(plane, producer, consumer):
    p = start("sparse-p", *producer, "kv_producer", plane)
    try:
        c = start("sparse-c", *consumer, "kv_consumer", plane)
        try:
            spec = LoadSpec.one_group("r", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
            assert run_load(c, spec) == {rank: ({"r"}, set(), set()) for rank in c.workers}
            names = set()
            for rank, caches in c.caches.items():
                assert len(caches) == 2 * NUM_LAYERS // consumer[1]
                for name, cache in caches.items():
                    names.add(name)
                    assert torch.equal(
                        cache.view(torch.uint8), expected(name, cache).view(torch.uint8)
                    ), f"{name} on consumer rank {rank}"
            assert len(names) == 2 * NUM_LAYERS
            for caches in p.caches.values():
                for name, cache in caches.items():
                    assert torch.equal(cache, produced(name, cache.shape[-1], cache.dtype)), name
        finally:
            c.shutdown()
    finally:
        p.shutdown()


@pytest.mark.parametrize("plane", ["rma", "tagged"])
@pytest.mark.parametrize(
    ("indexer", "words"),
    [((136, torch.uint8), "2 x 68 uint8"), ((66, torch.float16), "2 x 33 float16")],
    ids=["width", "dtype"],
)
def test_an_indexer_of_another_width_fails_the_load_naming_both(plane, indexer, words):
    p = start("wide-p", 1, 1, "kv_producer", plane)
    try:
        c = start("wide-c", 2, 1, "kv_consumer", plane, indexer=indexer)
        try:
            spec = LoadSpec.one_group("r", p.remote("pre", REMOTE_IDS), REMOTE_IDS, LOCAL_IDS)
            results = run_load(c, spec)
            for rank, worker in c.workers.items():
                assert results[rank][1] == {"r"}, rank
                reason = worker.get_load_failure_reasons()["r"]
                assert (
                    f"layer '{indexer_name(0)}' holds 2 x 66 uint8 per token and head on "
                    f"engine 'wide-p' and {words} per token and head on this engine" in reason
                ), reason
            for caches in c.caches.values():
                for cache in caches.values():
                    assert torch.all(cache == SENTINEL[cache.dtype])
        finally:
            c.shutdown()
    finally:
        p.shutdown()


def test_an_indexer_cache_needs_its_width_in_the_layout():
    native = rank_caches(1, (0, 0), True, INDEXER)
    ours = layout(1, 1, (0, 0), INDEXER)
    views = vllm_kv_views(native, ours, "last_axis")
    identity = WorkerIdentity.from_caches("e", ours, views)
    widths = {la.name: (la.head_dim, la.dtype) for la in identity.layers}
    assert widths[indexer_name(0)] == (66, "uint8")
    assert widths[latent_name(0)] == (None, None)
    assert (identity.head_dim, identity.dtype) == (288, "bfloat16")
    assert sorted({la.index for la in identity.layers}) == list(range(NUM_LAYERS))
    handshake = identity.handshake("YWRkcg==").layouts()
    assert (handshake[indexer_name(3)].head_dim, handshake[indexer_name(3)].dtype) == (66, "uint8")
    assert (handshake[latent_name(3)].head_dim, handshake[latent_name(3)].dtype) == (
        288,
        "bfloat16",
    )
    plain = KVCacheLayout(**{**ours.__dict__, "layer_widths": ()})
    with pytest.raises(
        ValueError,
        match=rf"KV cache '{indexer_name(0)}' has head_dim 66 of uint8; the other layers have "
        r"288 of bfloat16",
    ):
        WorkerIdentity.from_caches("e", plain, views)
    wrong = layout(1, 1, (0, 0), (136, torch.uint8))
    with pytest.raises(
        ValueError,
        match=rf"'{indexer_name(0)}' has head_dim 66 of uint8; the engine's layout says 68 of "
        r"uint8",
    ):
        WorkerIdentity.from_caches("e", wrong, views)
