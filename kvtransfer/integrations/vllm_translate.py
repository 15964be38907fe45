"""What the vLLM adapter translates, without importing vLLM (unit-testable with look-alikes).

vLLM objects are read by attribute only: its ``VllmConfig`` (model, cache and parallel
configs), its ``KVCacheConfig``, ``KVCacheBlocks``, ``SchedulerOutput`` and
``KVConnectorOutput``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.connector.metadata import KVCacheLayout, PpTpRank
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.transport.spec import dtype_name

# vLLM's CPU attention declares [blocks, heads, block_size, 2 * head_size] and reads it as
# [blocks, heads, 2 * block_size, head_size]: per head, K's tokens then V's.
VLLM_CPU_KV_ORDER = "BH2ND"


def vllm_kv_cache_layout(
    vllm_config: Any, kv_cache_config: Any | None, rank: PpTpRank | None
) -> KVCacheLayout:
    """Our `KVCacheLayout` for a vLLM engine (``rank`` is ``(pp_rank, tp_rank)`` on a worker,
    ``None`` on the scheduler)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    return KVCacheLayout(
        model=str(model.model),
        dtype=dtype_name(model.dtype) if isinstance(model.dtype, torch.dtype) else str(model.dtype),
        block_size=int(vllm_config.cache_config.block_size),
        num_blocks=int(num_blocks) if num_blocks else 1,
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_dim=int(model.get_head_size()),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        pp_rank=None if rank is None else rank[0],
        tp_rank=None if rank is None else rank[1],
        kv_order=VLLM_CPU_KV_ORDER,
    )


def physical_cpu_caches(
    kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
) -> dict[str, torch.Tensor]:
    """vLLM CPU caches reshaped (no copy) to their five physical axes, ``BH2ND``."""
    views = {}
    for name, cache in kv_caches.items():
        if cache.device.type != "cpu":
            raise ValueError(
                f"KV cache {name!r} is on {cache.device}: the vLLM adapter supports vLLM's CPU "
                "attention layout only (GPU backends order K and V differently)"
            )
        if cache.dim() != 4 or cache.shape[2] != layout.block_size or not cache.is_contiguous():
            raise ValueError(
                f"KV cache {name!r} has shape {tuple(cache.shape)}; vLLM's CPU layout is a "
                f"contiguous [num_blocks, kv_heads, {layout.block_size}, 2 * head_size]"
            )
        blocks, heads, tokens, both = cache.shape
        views[name] = cache.view(blocks, heads, 2, tokens, both // 2)
    return views


def single_group_block_ids(blocks: Any) -> list[int]:
    """The block ids of vLLM's ``KVCacheBlocks`` for a model with one KV cache group."""
    groups = blocks.get_block_ids()
    if len(groups) != 1:
        raise ValueError(
            f"the request has {len(groups)} KV cache groups; kvtransfer connectors in vLLM "
            "support models with one (full attention everywhere)"
        )
    return list(groups[0])


@dataclass(frozen=True)
class SchedulerStep:
    """The part of vLLM's ``SchedulerOutput`` our schedulers read. Layer-wise streaming is
    not offered inside vLLM, so cached requests' new blocks are not needed."""

    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    preempted_req_ids: frozenset[str] = frozenset()
    scheduled_cached_reqs: tuple[Any, ...] = ()

    @classmethod
    def of(cls, scheduler_output: Any) -> SchedulerStep:
        return cls(
            num_scheduled_tokens=dict(getattr(scheduler_output, "num_scheduled_tokens", {})),
            preempted_req_ids=frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ()),
        )


def connector_output(vllm_output: Any) -> KVConnectorOutput:
    """vLLM's aggregated ``KVConnectorOutput`` as ours (stats are not carried across)."""

    def ids(name: str) -> set[str] | None:
        found = getattr(vllm_output, name, None)
        return set(found) if found else None

    invalid = getattr(vllm_output, "invalid_block_ids", None)
    return KVConnectorOutput(
        finished_sending=ids("finished_sending"),
        finished_recving=ids("finished_recving"),
        failed_recving=ids("failed_recving"),
        invalid_block_ids=set(invalid) if invalid else None,
        expected_finished_count=int(getattr(vllm_output, "expected_finished_count", 0) or 0),
    )


@dataclass(frozen=True)
class RefusedLoad:
    """A request whose ``kv_transfer_params`` the scheduler refused: its workers report the
    load failed (and its blocks invalid), so vLLM applies ``kv_load_failure_policy``."""

    req_id: str
    block_ids: tuple[int, ...]
    reason: str
