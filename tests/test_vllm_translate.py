"""The vLLM adapter's translations, with look-alikes of vLLM 0.32's objects (vLLM not imported).

Covers `KVTransferConfig.from_vllm` and, from `kvtransfer.integrations.vllm_translate`,
`vllm_kv_cache_layout`, `vllm_kv_views` (checked against how each vLLM backend reads K and V,
on dense and block-outermost views), sparse MLA's latents and indexer caches (one group, each
layer its own width), the refusals of hybrid, MLA and malformed caches,
`group_block_ids`, `SchedulerStep.of` and `connector_output`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvtransfer.connector.config import KVTransferConfig, KVTransferConfigError
from kvtransfer.connector.kv_groups import FULL_ATTENTION, SLIDING_WINDOW
from kvtransfer.connector.metadata import KVCacheLayout, LayerWidth
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.integrations.vllm_translate import (
    VLLM_KV_ORDER,
    SchedulerStep,
    connector_output,
    group_block_ids,
    kv_split_for,
    leave_last_prompt_token,
    single_group_spec,
    state_page_view,
    vllm_kv_cache_layout,
    vllm_kv_views,
)

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------------------------
# Look-alikes of vLLM's objects (attributes only, as vLLM 0.32 spells them).


def vllm_kv_transfer_config(**overrides):
    """vLLM's ``KVTransferConfig`` with its defaults (kv_port 14579) unless overridden."""
    values = {
        "kv_connector": "KVTransferConnector",
        "engine_id": "engine-a",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cuda",
        "kv_connector_extra_config": {},
        "kv_port": 14579,
        "kv_load_failure_policy": "fail",
        "kv_connector_module_path": "kvtransfer.integrations.vllm",
    }
    values.update(overrides)
    return SimpleNamespace(**values)


@dataclass
class FakeModelConfig:
    model: str = "tiny-llama"
    dtype: torch.dtype = torch.float32
    num_layers: int = 3
    num_kv_heads: int = 4
    head_size: int = 8

    def get_total_num_hidden_layers(self) -> int:
        return self.num_layers

    def get_total_num_kv_heads(self) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


def vllm_config(block_size: int = 16, tp: int = 2, pp: int = 3):
    return SimpleNamespace(
        model_config=FakeModelConfig(),
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


@dataclass
class FakeKVCacheBlocks:
    groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


@dataclass
class FakeVllmKVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    expected_finished_count: int = 0


# ---------------------------------------------------------------------------------------------
# KVTransferConfig.from_vllm


def test_from_vllm_carries_vllm_fields_and_moves_kv_ip_out_of_extra():
    extra = {
        "kv_ip": "10.1.2.3",
        "kvtransfer_connector": "UcxConnector",
        "vllm_kv_split": "heads",
        "backends": ["UCX"],
    }
    source = vllm_kv_transfer_config(
        engine_id="engine-7",
        kv_role="kv_consumer",
        kv_port=14579,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    config = KVTransferConfig.from_vllm(source, "UcxConnector")

    assert config.kv_connector == "UcxConnector"
    assert config.engine_id == "engine-7"
    assert config.kv_role == "kv_consumer"
    assert config.kv_port == 14579
    assert config.kv_load_failure_policy == "recompute"
    assert config.kv_ip == "10.1.2.3"
    assert config.kv_connector_extra_config == {"backends": ["UCX"]}
    # vLLM's own dict is left as it was.
    assert extra == {
        "kv_ip": "10.1.2.3",
        "kvtransfer_connector": "UcxConnector",
        "vllm_kv_split": "heads",
        "backends": ["UCX"],
    }


def test_from_vllm_without_kv_ip_leaves_it_unset():
    config = KVTransferConfig.from_vllm(
        vllm_kv_transfer_config(kv_connector_extra_config={"shared_storage_path": "/tmp/kv"}),
        "SharedStorageConnector",
    )
    assert config.kv_ip is None
    assert config.kv_connector_extra_config == {"shared_storage_path": "/tmp/kv"}


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", "cpu"), ("cuda", "cuda"), ("xpu", None), (None, None)],
)
def test_from_vllm_keeps_only_buffer_devices_we_know(device, expected):
    config = KVTransferConfig.from_vllm(
        vllm_kv_transfer_config(kv_buffer_device=device), "UcxConnector"
    )
    assert config.kv_buffer_device == expected


def test_from_vllm_rejects_an_invalid_role_naming_the_key():
    with pytest.raises(KVTransferConfigError, match=r"kv_role: .*'kv_sender'"):
        KVTransferConfig.from_vllm(vllm_kv_transfer_config(kv_role="kv_sender"), "UcxConnector")


# ---------------------------------------------------------------------------------------------
# vllm_kv_cache_layout


@pytest.mark.parametrize(
    ("rank", "pp_rank", "tp_rank"),
    [(None, None, None), ((1, 0), 1, 0)],
    ids=["scheduler", "worker"],
)
def test_vllm_kv_cache_layout(rank, pp_rank, tp_rank):
    layout = vllm_kv_cache_layout(vllm_config(), SimpleNamespace(num_blocks=37), rank)
    assert layout == KVCacheLayout(
        model="tiny-llama",
        dtype="float32",
        block_size=16,
        num_blocks=37,
        num_layers=3,
        num_kv_heads=4,
        head_dim=8,
        tp_size=2,
        pp_size=3,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        kv_order="B2HND",
        null_block_id=0,
    )
    assert layout.rank == rank


def test_vllm_kv_cache_layout_without_kv_cache_config_has_one_block():
    layout = vllm_kv_cache_layout(vllm_config(), None, None)
    assert layout.num_blocks == 1
    assert layout.kv_order == VLLM_KV_ORDER == "B2HND"


# ---------------------------------------------------------------------------------------------
# vllm_kv_views

# Every axis its own size, so a swapped axis cannot pass.
BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE = 5, 4, 16, 8


def cpu_layout(block_size: int = BLOCK_SIZE) -> KVCacheLayout:
    return vllm_kv_cache_layout(
        vllm_config(block_size=block_size), SimpleNamespace(num_blocks=BLOCKS), (0, 0)
    )


def vllm_cache(strided: bool = False) -> torch.Tensor:
    """A layer's [B, H, N, 2D] view; ``strided``: one layer of a block-outermost buffer of two
    layers (vLLM's BLHNC), so its blocks are not adjacent."""
    numel = BLOCKS * HEADS * BLOCK_SIZE * 2 * HEAD_SIZE
    if not strided:
        values = torch.arange(numel, dtype=torch.float32)
        return values.view(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    buffer = torch.arange(2 * numel, dtype=torch.float32)
    both = buffer.view(BLOCKS, 2, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    return both[:, 1]


def backend_reads(cache: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, H, N, D], read the way each vLLM backend reads them."""
    if split == "rows":  # vLLM's CPU attention: per head, K's tokens then V's
        view = cache.reshape(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_SIZE)
        key, value = view.chunk(2, dim=2)
        return key, value
    if split == "last_axis":  # FlashAttention and friends: transpose(1, 2).split(D, -1)
        key, value = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        return key.transpose(1, 2), value.transpose(1, 2)
    key, value = cache.split(cache.shape[1] // 2, dim=1)  # FlashInfer NVFP4: K heads, V heads
    return key, value


@pytest.mark.parametrize("split", ["rows", "last_axis", "heads"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "block-outermost"])
def test_views_put_k_and_v_where_the_backend_reads_them(split, strided):
    cache = vllm_cache(strided)
    if split == "heads":
        cache = cache[..., :HEAD_SIZE]  # K and V heads of head_size each
    view = vllm_kv_views({"layer": cache}, cpu_layout(), split)["layer"]
    key, value = backend_reads(cache, split)
    heads = HEADS // 2 if split == "heads" else HEADS
    assert view.shape == (BLOCKS, 2, heads, BLOCK_SIZE, HEAD_SIZE)
    assert torch.equal(view[:, 0], key)
    assert torch.equal(view[:, 1], value)
    assert not torch.equal(key, value)
    view[1, 1, 0, 3, 4] = -1.0  # a view of vLLM's memory, not a copy
    assert value[1, 0, 3, 4].item() == -1.0


def test_the_cpu_backend_split_needs_dense_token_rows():
    # Tokens not adjacent within a head: vLLM's CPU attention could not view it either.
    cache = torch.zeros(BLOCKS, HEADS, 2 * HEAD_SIZE, BLOCK_SIZE).transpose(2, 3)
    with pytest.raises(ValueError, match="does not hold each head's tokens densely"):
        vllm_kv_views({"layer": cache}, cpu_layout(), "rows")


@pytest.mark.parametrize(
    ("cache", "block_size", "pattern"),
    [
        (
            torch.zeros(BLOCKS, HEADS, 2, BLOCK_SIZE, HEAD_SIZE),
            BLOCK_SIZE,
            r"'layer' is not a 4-D \[blocks, heads, block_size, C\] tensor .*MLA",
        ),
        (
            torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),
            24,
            r"'layer' has block size 16; the engine's layout says 24, which is not a whole",
        ),
        (
            torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 3 * HEAD_SIZE),
            BLOCK_SIZE,
            r"'layer' has a last axis of 24; K and V of head_dim 8 need 16",
        ),
    ],
    ids=["5-d", "not-a-kernel-block", "other-head-size"],
)
def test_vllm_kv_views_refuses(cache, block_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        vllm_kv_views({"layer": cache}, cpu_layout(block_size))


def test_the_split_follows_the_device_unless_configured():
    assert kv_split_for(torch.device("cpu")) == "rows"
    assert kv_split_for(torch.device("cuda", 0)) == "last_axis"
    assert kv_split_for(torch.device("cuda", 0), "heads") == "heads"
    with pytest.raises(ValueError, match=r"vllm_kv_split must be one of"):
        kv_split_for(torch.device("cpu"), "columns")


def _groups(*kinds: str):
    specs = [type(kind, (), {"dtype": torch.uint8})() for kind in kinds]
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec) for spec in specs],
    )


def test_sparse_mla_without_indexers_and_unknown_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"group 1 of 2 is CrossAttentionSpec \(encoder-decoder"):
        single_group_spec(_groups("FullAttentionSpec", "CrossAttentionSpec"))
    sparse = _groups("MLAAttentionSpec")
    sparse.kv_cache_groups[0].kv_cache_spec.topk_buffer_width = 2048
    with pytest.raises(ValueError, match=r"MLAAttentionSpec \(topk_buffer_width\).*not sparse"):
        single_group_spec(sparse)
    with pytest.raises(ValueError, match=r"group 0 of 1 is ChunkedLocalAttentionSpec \(chunked"):
        single_group_spec(_groups("ChunkedLocalAttentionSpec"))


def _hybrid(window: int, block_size: int = BLOCK_SIZE):
    full = type("FullAttentionSpec", (), {"dtype": torch.float32, "block_size": block_size})()
    local = type(
        "SlidingWindowSpec",
        (),
        {"dtype": torch.float32, "block_size": block_size, "sliding_window": window},
    )()
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=full, layer_names=["model.layers.1.self_attn.attn"]),
            SimpleNamespace(kv_cache_spec=local, layer_names=["model.layers.0.self_attn.attn"]),
        ],
    )


def test_a_sliding_window_model_is_two_groups_in_vllms_order():
    layout = vllm_kv_cache_layout(vllm_config(), _hybrid(48), (0, 0))
    assert [(g.kind, g.layer_names, g.sliding_window) for g in layout.groups] == [
        ("full_attention", ("model.layers.1.self_attn.attn",), None),
        ("sliding_window", ("model.layers.0.self_attn.attn",), 48),
    ]
    assert (layout.num_groups, layout.null_block_id) == (2, 0)
    # One full-attention group stays the layout's default: no groups listed.
    assert vllm_kv_cache_layout(vllm_config(), _groups("FullAttentionSpec"), (0, 0)).groups == ()
    with pytest.raises(ValueError, match=r"group 0 \(FullAttentionSpec\) has 64-token blocks"):
        vllm_kv_cache_layout(vllm_config(), _hybrid(48, block_size=64), (0, 0))


def _mla(latent: int):
    groups = _groups("MLAAttentionSpec")
    groups.kv_cache_groups[0].kv_cache_spec.head_size = latent
    return groups


def test_an_mla_cache_is_one_latent_head_moved_in_two_halves():
    # DeepSeek-V2: the model says 16 KV heads, but the cache holds one 576-wide latent per
    # token, the same on every TP rank.
    layout = vllm_kv_cache_layout(vllm_config(tp=2, pp=1), _mla(576), (0, 1))
    assert (layout.num_kv_heads, layout.head_dim, layout.tp_size) == (1, 288, 2)
    latent = torch.arange(BLOCKS * BLOCK_SIZE * 576, dtype=torch.float32)
    cache = latent.view(BLOCKS, 1, BLOCK_SIZE, 576)
    (view,) = vllm_kv_views({"model.layers.0.self_attn.attn": cache}, layout, "last_axis").values()
    assert view.shape == (BLOCKS, 2, 1, BLOCK_SIZE, 288)
    assert torch.equal(torch.cat([view[:, 0], view[:, 1]], dim=-1), cache)
    assert view.data_ptr() == cache.data_ptr()
    with pytest.raises(ValueError, match="needs an even width"):
        vllm_kv_cache_layout(vllm_config(), _mla(575), (0, 0))


class CacheRole(str, enum.Enum):  # noqa: UP042 (as vLLM spells it: str() is not the value)
    """vLLM 0.32's ``SparseCacheRole``."""

    SPARSE = "sparse"
    INDEXER = "indexer"


def _mla_spec(head_size: int, dtype: torch.dtype, role: CacheRole = CacheRole.SPARSE, **more):
    """A look-alike of vLLM 0.32's ``MLAAttentionSpec`` (its fields at their defaults)."""
    fields = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 1,
        "head_size": head_size,
        "dtype": dtype,
        "cache_role": role,
        "model_version": None,
        "alignment": None,
        "page_size_padded": None,
        "state_content_bytes": None,
        "num_head_slots": None,
        "tokens_per_state": 1,
        "is_index_group_leader": False,
    }
    fields.update(more)
    return type("MLAAttentionSpec", (), fields)()


LATENTS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
INDEXERS = ("model.layers.0.self_attn.indexer.k_cache", "model.layers.1.self_attn.indexer.k_cache")


def _sparse_mla(latent=None, indexer=None, **extra_specs):
    """vLLM's one ``UniformTypeKVCacheSpecs`` group of DeepSeek-V3.2's layers: each layer's
    latent and its indexer's k-cache (128 fp8 keys + a 4-byte scale: 132 bytes per token)."""
    latent = latent or _mla_spec(576, torch.bfloat16, is_index_group_leader=True)
    indexer = indexer or _mla_spec(132, torch.uint8, CacheRole.INDEXER, max_tp_shards=1)
    specs = {}
    for name_latent, name_indexer in zip(LATENTS, INDEXERS, strict=True):
        specs[name_latent], specs[name_indexer] = latent, indexer
    specs.update(extra_specs)
    uniform = type(
        "UniformTypeKVCacheSpecs", (), {"block_size": BLOCK_SIZE, "kv_cache_specs": specs}
    )()
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=uniform, layer_names=list(specs))],
    )


def test_sparse_mla_latents_and_indexer_caches_are_one_group_each_layer_its_width():
    config = vllm_config(block_size=BLOCK_SIZE, tp=2, pp=1)
    layout = vllm_kv_cache_layout(config, _sparse_mla(), (0, 1))
    # One full-attention group (the default: none listed), every block of every layer moved.
    assert layout.groups == ()
    assert (layout.num_kv_heads, layout.head_dim, layout.dtype) == (1, 288, "bfloat16")
    assert layout.layer_widths == tuple(LayerWidth(name, 66, "uint8") for name in INDEXERS)
    assert single_group_spec(_sparse_mla()).head_size == 576
    native = {
        LATENTS[0]: torch.randn(BLOCKS, 1, BLOCK_SIZE, 576).to(torch.bfloat16),
        INDEXERS[0]: torch.randint(0, 256, (BLOCKS, 1, BLOCK_SIZE, 132), dtype=torch.uint8),
    }
    views = vllm_kv_views(native, layout, "last_axis")
    for name, half in ((LATENTS[0], 288), (INDEXERS[0], 66)):
        assert views[name].shape == (BLOCKS, 2, 1, BLOCK_SIZE, half)
        assert torch.equal(torch.cat([views[name][:, 0], views[name][:, 1]], -1), native[name])
        assert views[name].data_ptr() == native[name].data_ptr()
    # fp8_ds_mla: a 656-byte opaque latent per token (vLLM sizes it by state_content_bytes).
    packed = _mla_spec(576, torch.uint8, state_content_bytes=656, is_index_group_leader=True)
    fp8 = vllm_kv_cache_layout(config, _sparse_mla(latent=packed), (0, 0))
    assert (fp8.head_dim, fp8.dtype) == (328, "uint8")
    assert fp8.layer_widths == tuple(LayerWidth(name, 66, "uint8") for name in INDEXERS)
    # vLLM 0.33 marks sparse latents with the top-k buffer's width: moved beside indexers too.
    topk = _mla_spec(576, torch.bfloat16, topk_buffer_width=2048)
    assert vllm_kv_cache_layout(config, _sparse_mla(latent=topk), (0, 0)).head_dim == 288


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (
            _sparse_mla(**{"model.layers.2.self_attn.attn": type("FullAttentionSpec", (), {})()}),
            r"group 0 of 1 is UniformTypeKVCacheSpecs \(layers of one kind with unequal page "
            r"sizes: FullAttentionSpec, MLAAttentionSpec",
        ),
        (
            _sparse_mla(latent=_mla_spec(576, torch.bfloat16, block_size=32)),
            r"UniformTypeKVCacheSpecs .*block sizes \[16, 32\]",
        ),
        (
            _sparse_mla(latent=_mla_spec(132, torch.uint8, CacheRole.INDEXER)),
            r"UniformTypeKVCacheSpecs .*only as sparse MLA \(MLAAttentionSpec latents and",
        ),
        (
            _sparse_mla(indexer=_mla_spec(131, torch.uint8, CacheRole.INDEXER)),
            r"MLA layer 'model.layers.0.self_attn.indexer.k_cache' \(indexer cache\) has 131 "
            r"elements per token; kvtransfer moves it as two halves and needs an even width",
        ),
    ],
    ids=["other-kind", "block-size", "no-latent", "odd"],
)
def test_other_uniform_groups_are_refused_by_name(config, pattern):
    with pytest.raises(ValueError, match=pattern):
        vllm_kv_cache_layout(vllm_config(block_size=BLOCK_SIZE, pp=1), config, (0, 0))


def test_sparse_latents_without_their_indexer_caches_are_refused():
    # vLLM 0.32 flags a latent owning an indexer; without the indexer's k-cache beside it a
    # decode could not select its prompt's tokens.
    alone = SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(
                kv_cache_spec=_mla_spec(576, torch.bfloat16, is_index_group_leader=True),
                layer_names=list(LATENTS),
            )
        ],
    )
    with pytest.raises(ValueError, match=r"MLAAttentionSpec \(is_index_group_leader\).*not "
                       r"sparse latents without their indexer cache"):  # fmt: skip
        single_group_spec(alone)
    alone.kv_cache_groups[0].kv_cache_spec = _mla_spec(576, torch.bfloat16)
    assert single_group_spec(alone).head_size == 576  # DeepSeek V2/V3: a plain latent


def test_an_fp8_cache_is_moved_as_bytes_with_its_format_in_the_layout():
    config = vllm_config()
    config.cache_config.cache_dtype = "fp8_e4m3"
    layout = vllm_kv_cache_layout(config, _groups("FullAttentionSpec"), (0, 0))
    assert (layout.dtype, layout.cache_dtype) == ("uint8", "fp8_e4m3")


# ---------------------------------------------------------------------------------------------
# group_block_ids


def test_group_block_ids_gives_one_list_or_one_per_group():
    group = [3, 1, 4]
    ids = group_block_ids(FakeKVCacheBlocks((group,)), 1)
    assert ids == [3, 1, 4]
    assert type(ids) is list
    assert ids is not group
    assert group_block_ids(FakeKVCacheBlocks(([0, 1], [2, 3])), 2) == ([0, 1], [2, 3])


def test_group_block_ids_refuses_lists_that_do_not_match_the_groups():
    with pytest.raises(
        ValueError, match=r"the request has 2 KV cache groups; the engine's layout has 1"
    ):
        group_block_ids(FakeKVCacheBlocks(([0, 1], [2, 3])), 1)


# ---------------------------------------------------------------------------------------------
# SchedulerStep.of


@pytest.mark.parametrize(
    ("preempted", "expected"),
    [(None, frozenset()), (set(), frozenset()), ({"r2", "r3"}, frozenset({"r2", "r3"}))],
)
def test_scheduler_step_of(preempted, expected):
    scheduled = {"r1": 7, "r4": 1}
    step = SchedulerStep.of(
        SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=preempted)
    )
    assert dict(step.num_scheduled_tokens) == {"r1": 7, "r4": 1}
    assert step.preempted_req_ids == expected
    assert isinstance(step.preempted_req_ids, frozenset)
    assert step.scheduled_cached_reqs == ()
    scheduled["r5"] = 2  # a copy: vLLM reusing its dict does not change the step
    assert "r5" not in step.num_scheduled_tokens


# ---------------------------------------------------------------------------------------------
# connector_output


def test_connector_output_of_an_empty_vllm_output_is_all_none():
    output = connector_output(
        FakeVllmKVConnectorOutput(finished_sending=set(), finished_recving=set())
    )
    assert output == KVConnectorOutput()


def test_connector_output_copies_what_vllm_reports():
    source = FakeVllmKVConnectorOutput(
        finished_sending={"a"},
        finished_recving={"b", "c"},
        failed_recving={"c"},
        invalid_block_ids={4, 9},
        expected_finished_count=3,
    )
    output = connector_output(source)
    assert output == KVConnectorOutput(
        finished_sending={"a"},
        finished_recving={"b", "c"},
        failed_recving={"c"},
        invalid_block_ids={4, 9},
        expected_finished_count=3,
    )
    assert output.finished_sending is not source.finished_sending
    assert output.finished_recving is not source.finished_recving
    assert output.failed_recving is not source.failed_recving
    assert output.invalid_block_ids is not source.invalid_block_ids


def _with_state(mode: str = "none", spec_blocks: int = 0):
    state = type(
        "MambaSpec",
        (),
        {"block_size": 2048, "mamba_cache_mode": mode, "num_speculative_blocks": spec_blocks},
    )()
    full = type("FullAttentionSpec", (), {"dtype": torch.float32, "block_size": BLOCK_SIZE})()
    return SimpleNamespace(
        num_blocks=BLOCKS,
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=state, layer_names=["model.layers.0.mixer"]),
            SimpleNamespace(kv_cache_spec=full, layer_names=["model.layers.1.mixer.attn"]),
        ],
    )


def test_a_mamba_group_is_a_recurrent_state_group_beside_attention():
    layout = vllm_kv_cache_layout(vllm_config(), _with_state(spec_blocks=2), (0, 0))
    assert [(g.kind, g.layer_names, g.speculative_blocks) for g in layout.groups] == [
        ("recurrent_state", ("model.layers.0.mixer",), 2),
        ("full_attention", ("model.layers.1.mixer.attn",), 0),
    ]
    # Its own block size (vLLM sizes state pages like attention pages) is not refused.
    assert layout.dtype == "float32"
    with pytest.raises(ValueError, match=r"mamba_cache_mode 'align'.*--no-enable-prefix-caching"):
        vllm_kv_cache_layout(vllm_config(), _with_state("align"), (0, 0))
    only_state = _with_state()
    only_state.kv_cache_groups = only_state.kv_cache_groups[:1]
    with pytest.raises(ValueError, match="no attention layer"):
        single_group_spec(only_state)


def test_a_state_page_is_viewed_as_two_byte_halves_of_the_same_memory():
    page, stride = 10, 16  # 10 state bytes in 16-byte pages (vLLM pads them)
    raw = torch.arange(BLOCKS * stride, dtype=torch.uint8).view(torch.int8)
    cache = raw.as_strided((BLOCKS, 1, 1, page), (stride, page, page, 1))
    view = state_page_view("model.layers.0.mixer", cache)
    assert view.shape == (BLOCKS, 2, 1, 1, page // 2) and view.dtype == torch.uint8
    assert view.data_ptr() == cache.data_ptr()
    assert torch.equal(view[3].reshape(-1), cache[3].reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="not an even number of dense bytes"):
        state_page_view("x", raw.as_strided((BLOCKS, 1, 1, 9), (stride, 9, 9, 1)))
    with pytest.raises(ValueError, match="not one \\[blocks, 1, 1, bytes\\] page tensor"):
        state_page_view("x", [cache, cache])


def _vllm_request(prompt: list[int], params: dict | None):
    return SimpleNamespace(
        prompt_token_ids=list(prompt),
        _all_token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        max_tokens=16,
        kv_transfer_params=params,
        get_skip_reading_prefix_cache=lambda: False,
    )


def test_a_prefill_for_a_state_model_leaves_its_last_prompt_token_once():
    request = _vllm_request([5, 6, 7], {"do_remote_decode": True})
    leave_last_prompt_token(request)
    leave_last_prompt_token(request)  # seen again after a preemption: not cut twice
    assert (request.prompt_token_ids, request._all_token_ids) == ([5, 6], [5, 6])
    assert (request.num_prompt_tokens, request.max_tokens) == (2, 1)
    one = _vllm_request([5], {"do_remote_decode": True})
    leave_last_prompt_token(one)
    assert one.prompt_token_ids == [5]


def _v4_spec(kind: str, block_size: int, head_size: int, **more):
    fields = {
        "block_size": block_size,
        "num_kv_heads": 1,
        "head_size": head_size,
        "dtype": torch.uint8,
        "cache_role": CacheRole.SPARSE,
        "model_version": "deepseek_v4",
        "alignment": 576,
        "page_size_padded": None,
        "state_content_bytes": None,
        "num_head_slots": None,
        "tokens_per_state": 1,
        "sliding_window": None,  # FullAttentionSpec's field, None in MLA specs
    }
    fields.update(more)
    return type(kind, (), fields)()


def _v4_groups(**overrides):
    """DeepSeek-V4's groups as vLLM 0.33 packs them: sliding-window latents (64-token blocks,
    window 128), compressed latents and indexer caches (256-token blocks, 4 tokens a state),
    compressor states (4-token blocks, window 8)."""
    swa = _v4_spec("SlidingWindowMLASpec", 64, 584, sliding_window=128, extra_retained_tokens=0)
    compressed = _v4_spec("MLAAttentionSpec", 256, 512, tokens_per_state=4)
    indexer = _v4_spec("MLAAttentionSpec", 256, 132, tokens_per_state=4, model_version=None)
    state = _v4_spec("SlidingWindowMLASpec", 4, 2048, sliding_window=8, model_version=None)
    layers = {
        "swa": {
            "model.layers.0.self_attn.swa_cache": swa,
            "model.layers.1.self_attn.swa_cache": swa,
        },
        "compressed": {
            "model.layers.1.self_attn": compressed,
            "model.layers.1.self_attn.indexer.k_cache": indexer,
        },
        "state": {"model.layers.1.self_attn.compressor.state_cache": state},
    }
    for where, specs in overrides.items():
        layers[where].update(specs)
    groups = []
    for specs in layers.values():
        first = next(iter(specs.values()))
        uniform = type(
            "UniformTypeKVCacheSpecs",
            (),
            {"block_size": first.block_size, "kv_cache_specs": specs},
        )()
        groups.append(SimpleNamespace(kv_cache_spec=uniform, layer_names=list(specs)))
    return SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=groups)


def test_deepseek_v4_groups_move_as_whole_pages_at_their_own_block_sizes():
    config = vllm_config(block_size=256, tp=2, pp=1)
    layout = vllm_kv_cache_layout(config, _v4_groups(), (0, 1))
    swa, compressed, state = layout.groups
    assert (swa.kind, swa.sliding_window, swa.block_size, swa.whole_pages) == (
        SLIDING_WINDOW,
        128,
        64,
        True,
    )
    assert (compressed.kind, compressed.block_size, compressed.whole_pages) == (
        FULL_ATTENTION,
        None,  # the engine's
        True,
    )
    assert compressed.layer_names == (
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.indexer.k_cache",
    )
    assert (state.sliding_window, state.block_size, state.blocks_kept(256)) == (8, 4, 3)
    assert swa.blocks_kept(256) == 3 and swa.blocks_for(300, 256) == 5
    assert swa.label == "sliding_window:128/64" and compressed.label == FULL_ATTENTION
    assert layout.layer_widths == ()  # pages, not per-token vectors
    # vLLM's packed view: [blocks, 1, states, C] dense per block, blocks strided by the pack.
    buffer = torch.randn(BLOCKS * 2250)
    native = buffer.as_strided((BLOCKS, 1, 4, 512), (2250, 2048, 512, 1), 25)
    name = "model.layers.1.self_attn.compressor.state_cache"
    (view,) = vllm_kv_views({name: native}, layout).values()
    assert view.shape == (BLOCKS, 2, 1, 1, 4096)
    for block in (0, BLOCKS - 1):
        page = torch.cat([view[block, 0, 0, 0], view[block, 1, 0, 0]])
        assert torch.equal(page, native[block].contiguous().view(torch.uint8).flatten())


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"swa": {"model.layers.2.self_attn": _v4_spec("MLAAttentionSpec", 64, 512)}},
            r"group 0 of 3 holds DeepSeek-V4 MLA pages with layers of kinds "
            r"\['MLAAttentionSpec', 'SlidingWindowMLASpec'\]",
        ),
        (
            {
                "state": {
                    "model.layers.2.self_attn.compressor.state_cache": _v4_spec(
                        "SlidingWindowMLASpec", 8, 1024, sliding_window=128
                    )
                }
            },
            r"group 2 of 3 .* windows \[8, 128\] and block sizes \[4, 8\]",
        ),
        (
            {
                "swa": {
                    "model.layers.0.self_attn.swa_cache": _v4_spec(
                        "SlidingWindowMLASpec", 64, 584, sliding_window=128, num_kv_heads=2
                    )
                }
            },
            r"group 0 of 3 .* several heads per page, which TP would split",
        ),
        (
            {
                "swa": {
                    "model.layers.0.self_attn.swa_cache": _v4_spec(
                        "SlidingWindowMLASpec", 64, 584, sliding_window=128, bounded_replay=True
                    )
                }
            },
            r"group 0 of 3 .* bounded replay",
        ),
    ],
    ids=["kinds", "windows", "heads", "replay"],
)
def test_deepseek_v4_groups_of_mixed_pages_are_refused_by_name(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        vllm_kv_cache_layout(
            vllm_config(block_size=256, tp=1, pp=1), _v4_groups(**overrides), (0, 0)
        )
