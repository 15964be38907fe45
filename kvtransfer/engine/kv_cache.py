"""How many KV blocks an engine has, and the per-layer cache tensors a worker allocates.

Every worker and the scheduler must agree on the block count, so it is computed from the
configuration alone (whole model, all KV heads, drafter included), not from what one rank holds.
"""

from __future__ import annotations

import torch

from kvtransfer.engine.config import EngineConfig, ModelConfig

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
