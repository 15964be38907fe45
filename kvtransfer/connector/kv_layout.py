"""The axis orders a KV cache may be stored in, and the one view connectors index it through.

One attention layer's cache is indexed ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``
(axes ``B2HND``: block, K/V, head, token, head dim). Engines lay those axes out differently in
memory (vLLM's CPU backend ``BH2ND``, its GPU backends ``2BNHD``/``2BHND``); the engine declares
its order in `KVCacheLayout.kv_order` and connectors see `canonical_kv_view` of each tensor.
"""

from __future__ import annotations

import torch

KV_CACHE_NDIM = 5
# Block, K/V, head, token, head dim: the order payloads use and caches are indexed in.
KV_AXES = "B2HND"


def axis_order(name: str, order: object) -> str:
    if not isinstance(order, str) or sorted(order) != sorted(KV_AXES):
        raise ValueError(
            f"{name} must name the axes {KV_AXES!r} (block, K/V, head, token, head dim) once "
            f"each, outermost first, e.g. 'B2HND' or 'BH2ND'; got {order!r}"
        )
    return order


def canonical_kv_view(tensor: torch.Tensor, order: str) -> torch.Tensor:
    """View ``tensor``, whose 5 axes are ``order`` (a permutation of ``KV_AXES``), in
    ``B2HND`` order; no copy. (An engine that declares fewer axes, like vLLM's CPU cache,
    reshapes its tensor to its 5 physical axes first.)"""
    order = axis_order("KV axis order", order)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"a KV cache must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != KV_CACHE_NDIM or tensor.shape[order.index("2")] != 2:
        raise ValueError(
            f"a KV cache in order {order!r} must have 5 axes with 2 at position "
            f"{order.index('2')}, got shape {tuple(tensor.shape)}"
        )
    return tensor.permute(*(order.index(axis) for axis in KV_AXES))


def kv_axis_order(tensor: torch.Tensor) -> str:
    """The physical order of a ``B2HND``-indexed cache's axes, outermost first."""
    ranked = sorted(range(KV_CACHE_NDIM), key=lambda axis: -tensor.stride(axis))
    return "".join(KV_AXES[axis] for axis in ranked)
