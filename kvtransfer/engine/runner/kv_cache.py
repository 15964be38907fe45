"""How many KV blocks an engine has, and the per-layer cache tensors a worker allocates.

Every worker and the scheduler must agree on the block count, so it is computed from the
configuration alone (whole model, all KV heads, drafter included), not from what one rank holds.

A hybrid model's KV cache groups share the pool: a block id belongs to one group of one request,
so the i-th layer of every group can keep its KV in one tensor (as vLLM's hybrid allocator
does), and a block costs the bytes of the largest group's layers, not of every layer.
"""

from __future__ import annotations

import torch

from kvtransfer.connector.kv_groups import (
    FULL_ATTENTION,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    KVCacheGroup,
)
from kvtransfer.connector.metadata import KVCacheLayout
from kvtransfer.engine.config import (
    MAMBA,
    NULL_BLOCK_ID,
    SLIDING_ATTENTION,
    EngineConfig,
    ModelConfig,
)
from kvtransfer.engine.model.mamba import mamba_state_bytes
from kvtransfer.engine.parallel import ParallelRank

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on GPU."""
    if config.dtype == "auto":
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    return _DTYPES[config.dtype]


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """What one block costs: the largest attention group's layers (the groups share tensors),
    plus every recurrent-state layer's whole state (its own tensor, one page per block)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * model.num_key_value_heads * block_size * model.head_dim * element_size
    sizes = _group_sizes(model)
    attention = [n for kind, n in zip(model.kv_group_kinds, sizes, strict=True) if kind != MAMBA]
    states = sum(n for kind, n in zip(model.kv_group_kinds, sizes, strict=True) if kind == MAMBA)
    return per_layer * max(attention) + states * mamba_state_bytes(model, model.mamba_num_heads)


def _group_sizes(model: ModelConfig) -> list[int]:
    sizes = [0] * model.num_kv_groups
    for layer in range(model.num_hidden_layers):
        sizes[model.kv_group_of_layer(layer)] += 1
    return sizes


def extra_kv_groups(model: ModelConfig) -> tuple[int | None, ...]:
    """The block manager's view of the groups after group 0: a window, or ``None`` (state)."""
    return tuple(
        model.sliding_window if kind == SLIDING_ATTENTION else None
        for kind in model.kv_group_kinds[1:]
    )


def kv_cache_groups(
    model: ModelConfig, draft_layer_names: tuple[str, ...] = ()
) -> tuple[KVCacheGroup, ...]:
    """A hybrid model's KV cache groups as connectors see them (none for a one-group model):
    full attention (the drafter's layers with it), then sliding-window, then recurrent-state."""
    if not model.is_hybrid:
        return ()
    names: list[list[str]] = [[] for _ in range(model.num_kv_groups)]
    for layer in range(model.num_hidden_layers):
        mixer = "mamba" if model.layer_type(layer) == MAMBA else "self_attn"
        names[model.kv_group_of_layer(layer)].append(f"model.layers.{layer}.{mixer}")
    groups = [KVCacheGroup(FULL_ATTENTION, (*names[0], *draft_layer_names))]
    for kind, layers in zip(model.kv_group_kinds[1:], names[1:], strict=True):
        if kind == SLIDING_ATTENTION:
            groups.append(KVCacheGroup(SLIDING_WINDOW, tuple(layers), model.sliding_window))
        else:
            # Pages laid out per head: engines of other TP sizes read the heads they hold.
            groups.append(
                KVCacheGroup(RECURRENT_STATE, tuple(layers), state_heads=model.mamba_num_heads)
            )
    return tuple(groups)


def group_caches(
    layer_groups: dict[str, int],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One cache per layer name: the i-th attention layer of every group shares the i-th
    tensor; a layer with a dtype of its own (a recurrent state's pages) has its own."""
    tensors: list[torch.Tensor] = []
    seen = [0] * (1 + max(layer_groups.values(), default=0))
    caches = {}
    for name, group in layer_groups.items():
        shape, own_dtype = specs[name]
        if own_dtype is not None:
            caches[name] = torch.zeros(shape, dtype=own_dtype, device=device)
            continue
        if seen[group] == len(tensors):
            tensors.append(torch.zeros(shape, dtype=dtype, device=device))
        caches[name] = tensors[seen[group]]
        seen[group] += 1
    return caches


def num_kv_blocks(
    config: EngineConfig, target: ModelConfig, drafter: ModelConfig | None = None
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = resolve_dtype(config)
    per_block = kv_bytes_per_block(target, config.block_size, dtype)
    if drafter is not None:
        per_block += kv_bytes_per_block(drafter, config.block_size, dtype)
    return max(1, config.kv_cache_bytes // per_block)


def kv_cache_layout(
    config: EngineConfig,
    model: ModelConfig,
    num_blocks: int,
    rank: ParallelRank | None = None,
    draft_layer_names: tuple[str, ...] = (),
) -> KVCacheLayout:
    """The layout handed to a connector as ``kv_cache_config`` (``rank`` ``None`` on the
    scheduler)."""
    groups = kv_cache_groups(model, draft_layer_names)
    return KVCacheLayout(
        model=config.model,
        dtype=str(resolve_dtype(config)).removeprefix("torch."),
        block_size=config.block_size,
        num_blocks=num_blocks,
        num_layers=model.num_hidden_layers,
        num_kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        tp_size=config.tensor_parallel_size,
        pp_size=config.pipeline_parallel_size,
        tp_rank=None if rank is None else rank.tp_rank,
        pp_rank=None if rank is None else rank.pp_rank,
        groups=groups,
        null_block_id=NULL_BLOCK_ID if groups else None,
    )
