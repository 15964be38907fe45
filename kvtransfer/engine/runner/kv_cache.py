"""How many KV blocks an engine has, and the per-layer cache tensors a worker allocates.

Every worker and the scheduler must agree on the block count, so it is computed from the
configuration alone (whole model, all KV heads, drafter included), not from what one rank holds.
"""

from __future__ import annotations

import torch

from kvtransfer.connector.metadata import KVCacheLayout
from kvtransfer.engine.config import EngineConfig, ModelConfig
from kvtransfer.engine.parallel import ParallelRank

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on GPU."""
    if config.dtype == "auto":
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    return _DTYPES[config.dtype]


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * model.num_key_value_heads * block_size * model.head_dim * element_size
    return per_layer * model.num_hidden_layers


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
    config: EngineConfig, model: ModelConfig, num_blocks: int, rank: ParallelRank | None = None
) -> KVCacheLayout:
    """The layout handed to a connector as ``kv_cache_config`` (``rank`` ``None`` on the
    scheduler)."""
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
    )
