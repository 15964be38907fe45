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

from kvtransfer.connector.kv_groups import (
    FULL_ATTENTION,
    RECURRENT_STATE,
    SLIDING_WINDOW,
    KVCacheGroup,
)
from kvtransfer.connector.metadata import KVCacheLayout, LayerWidth, PpTpRank
from kvtransfer.connector.outputs import KVConnectorOutput
from kvtransfer.integrations.vllm_state import vllm_state_parts
from kvtransfer.transport.spec import dtype_name

# How a vLLM backend reads K and V out of a layer's 4-D [blocks, heads, block_size, C] view:
# "rows": vLLM's CPU attention: C is 2 * head_size and a head's [block_size, C] is read as
#         [2 * block_size, head_size], K's tokens then V's;
# "last_axis": FlashAttention, FlashInfer, Triton, FlexAttention: C is [K | V] per token and
#         head (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``);
# "heads": the head axis holds K's heads then V's (FlashInfer's NVFP4 path).
KV_SPLITS = ("rows", "last_axis", "heads")
# The views handed to our connectors are B2HND-indexed whatever vLLM's physical layout.
VLLM_KV_ORDER = "B2HND"
VLLM_NULL_BLOCK_ID = 0
# kvtransfer connectors whose transfers never depend on vLLM's per-layer hooks (which a full
# CUDA graph does not replay): they load in start_load_kv and save in wait_for_save or on
# background threads. UcxConnector's save_kv_layer only makes a streaming lease's layer
# servable early on CPU caches; on a GPU the layer is served from the next start_load_kv.
# SharedStorageConnector has no layer hooks.
LAYER_HOOK_FREE = frozenset({"UcxConnector", "SharedStorageConnector"})


def check_deployment(vllm_config: Any) -> None:
    """`ValueError` at start-up, naming the limit, for what the adapter cannot serve right:

    * ``kv_buffer_device`` "cpu" with caches on an accelerator: vLLM then expects the connector
      to stage KV through host buffers with the copy op of ``set_host_xfer_buffer_ops``; ours
      register the device caches themselves and keep no host mirror, so a pull would read (and
      a load write) memory vLLM never copies back;
    * context parallelism (prefill or decode): each rank then holds a slice of the tokens (and
      vLLM files a rank's handshake under ``tp_rank + pcp_rank * tp_size``), which kvtransfer's
      head-sliced transfers do not describe."""
    kv_buffer_device = vllm_config.kv_transfer_config.kv_buffer_device
    device = str(vllm_config.device_config.device_type)
    if kv_buffer_device == "cpu" and device != "cpu":
        raise ValueError(
            f"kv_buffer_device 'cpu' (KV staged through host buffers) is not supported by "
            f"kvtransfer connectors in vLLM: the KV caches are on {device} and are registered "
            f"where they are, with no host copy; set kv_buffer_device to {device!r} (the "
            "default)"
        )
    parallel = vllm_config.parallel_config
    pcp = int(parallel.prefill_context_parallel_size)
    dcp = int(parallel.decode_context_parallel_size)
    if pcp > 1 or dcp > 1:
        raise ValueError(
            f"context parallelism (prefill {pcp}, decode {dcp}) is not supported by kvtransfer "
            "connectors in vLLM: its ranks hold slices of the tokens' KV, which the connectors "
            "do not transfer; run with prefill and decode context parallel size 1"
        )


def needs_piecewise_cudagraph(name: str | None, extra_config: Mapping[str, Any] | None) -> bool:
    """Whether vLLM must capture CUDA graphs piecewise for the kvtransfer connector ``name``
    (configured by ``extra_config``): a full graph skips ``wait_for_layer_load`` and
    ``save_kv_layer``. False only for connectors known not to need those hooks
    (`LAYER_HOOK_FREE`), and for a MultiConnector all of whose children are; any other
    connector (a third party's may stream layer by layer) or a malformed child list: True,
    which costs speed, never correctness."""
    if name == "MultiConnector":
        children = (extra_config or {}).get("connectors")
        if not isinstance(children, list) or not children:
            return True
        return any(
            not isinstance(child, Mapping)
            or needs_piecewise_cudagraph(
                child.get("kv_connector"), child.get("kv_connector_extra_config")
            )
            for child in children
        )
    return name not in LAYER_HOOK_FREE


def vllm_kv_cache_layout(
    vllm_config: Any, kv_cache_config: Any | None, rank: PpTpRank | None
) -> KVCacheLayout:
    """Our `KVCacheLayout` for a vLLM engine (``rank`` is ``(pp_rank, tp_rank)`` on a worker,
    ``None`` on the scheduler)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    spec = single_group_spec(kv_cache_config)
    # The cache's own element type (uint8 for fp8 caches: moved as bytes), else the model's.
    element = getattr(spec, "dtype", None) or model.dtype
    dtype = dtype_name(element) if isinstance(element, torch.dtype) else str(element)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    widths: tuple[LayerWidth, ...] = ()
    if uses_mla(vllm_config, spec):
        # One latent per token, the same on every TP rank: one "head" whose last axis is
        # the latent, moved as two halves (K's and V's places), so TP ranks replicate it.
        latent = _mla_width(spec) or int(model.get_head_size())
        if latent % 2:
            raise ValueError(
                f"the MLA latent has {latent} elements per token; kvtransfer moves it as two "
                "halves and needs an even width"
            )
        num_kv_heads, head_dim = 1, latent // 2
        # Sparse MLA's indexer k-caches: one vector per token too, of their own width.
        widths = _mla_layer_widths(kv_cache_config, head_dim, dtype)
    else:
        num_kv_heads, head_dim = model.get_total_num_kv_heads(), model.get_head_size()
    return KVCacheLayout(
        model=str(model.model),
        dtype=dtype,
        cache_dtype=cache_dtype,
        block_size=int(vllm_config.cache_config.block_size),
        num_blocks=int(num_blocks) if num_blocks else 1,
        num_layers=int(model.get_total_num_hidden_layers()),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        pp_rank=None if rank is None else rank[0],
        tp_rank=None if rank is None else rank[1],
        kv_order=VLLM_KV_ORDER,
        groups=vllm_kv_groups(
            kv_cache_config, int(vllm_config.cache_config.block_size), vllm_config
        ),
        # vLLM's block pool hands out its first block as the null block every request's
        # skipped (out-of-window) positions point at.
        null_block_id=VLLM_NULL_BLOCK_ID,
        layer_widths=widths,
    )


def _mla_width(spec: Any) -> int | None:
    """Elements per token of an MLA layer's cache (None: the spec does not say): ds_mla
    formats (``fp8_ds_mla``: 656 bytes) pack NoPE, RoPE and scales into one opaque per-token
    blob that vLLM sizes by ``state_content_bytes``, not by ``head_size``."""
    content = getattr(spec, "state_content_bytes", None)
    dtype = getattr(spec, "dtype", None)
    if content is not None and isinstance(dtype, torch.dtype):
        return int(content) // dtype.itemsize
    head = getattr(spec, "head_size", None)
    return int(head) if head else None


def _mla_layer_widths(
    kv_cache_config: Any | None, head_dim: int, dtype: str
) -> tuple[LayerWidth, ...]:
    """The MLA layers whose per-token vector is not the engine's latent (``head_dim`` x 2 of
    ``dtype``): sparse MLA's indexer k-caches. `ValueError` naming a layer of odd width."""
    widths = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        if is_whole_page_group(group.kv_cache_spec):
            continue  # moved as pages, not per-token vectors
        for name, spec in _layer_specs(group).items():
            if "MLA" not in type(spec).__name__:
                continue
            width = _mla_width(spec)
            if width is None:
                continue
            if width % 2:
                raise ValueError(
                    f"MLA layer {name!r} ({_role(spec)} cache) has {width} elements per token; "
                    "kvtransfer moves it as two halves and needs an even width"
                )
            own = getattr(spec, "dtype", None)
            own = dtype_name(own) if isinstance(own, torch.dtype) else str(own or dtype)
            if (width // 2, own) != (head_dim, dtype):
                widths.append(LayerWidth(name, width // 2, own))
    return tuple(widths)


def _layer_specs(group: Any) -> dict[str, Any]:
    """Each layer's spec in one of vLLM's ``KVCacheGroupSpec``s."""
    spec = group.kv_cache_spec
    if type(spec).__name__ == _UNIFORM:
        return dict(getattr(spec, "kv_cache_specs", None) or {})
    return {name: spec for name in getattr(group, "layer_names", ()) or ()}


def _specs_in(spec: Any) -> list[Any]:
    """A group's spec, or a ``UniformTypeKVCacheSpecs``'s per-layer specs."""
    if type(spec).__name__ == _UNIFORM:
        return list((getattr(spec, "kv_cache_specs", None) or {}).values())
    return [spec]


def uses_mla(vllm_config: Any, spec: Any | None) -> bool:
    """Whether the engine's KV cache is MLA latents (its spec says so, or, before vLLM made
    one, its model config)."""
    if spec is not None:
        return "MLA" in type(spec).__name__
    return bool(getattr(vllm_config.model_config, "use_mla", False))


# MLA variants whose caches are more than one latent plane per layer, or padded pages.
_MLA_EXTRAS = ("topk_buffer_width", "model_version", "page_size_padded", "alignment")
# Sparse MLA (DeepSeek-V3.2, GLM-5): each layer's latent (``MLAAttentionSpec``, cache_role
# "sparse", vLLM's default) has its lightning indexer's k-cache beside it as a layer of its own
# (``<layer>.self_attn.indexer.k_cache``: cache_role "indexer", one vector of keys and scales
# per token, the same on every TP rank). The two page sizes differ, so vLLM groups them as one
# `_UNIFORM` group: one block table, every block of every layer moved whole.
_INDEXER_ROLE = "indexer"
_UNIFORM = "UniformTypeKVCacheSpecs"
# What marks a latent as sparse: vLLM 0.33's top-k buffer width; vLLM 0.32's flag on a layer
# owning an indexer. A decode needs the indexer's keys of the prompt: such latents move only
# beside indexer caches.
_SPARSE_MARKS = ("topk_buffer_width", "is_index_group_leader")
# vLLM's KV cache specs our connectors move, by the group kind they are (`kv_groups`).
_GROUP_KINDS = {
    "FullAttentionSpec": FULL_ATTENTION,
    "MLAAttentionSpec": FULL_ATTENTION,
    "SlidingWindowSpec": SLIDING_WINDOW,
    "MambaSpec": RECURRENT_STATE,
}
# What the others hold, for the start-up refusal.
_NOT_MOVED = {
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "CrossAttentionSpec": "encoder-decoder cross attention",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SinkFullAttentionSpec": "attention sinks",
}


def single_group_spec(kv_cache_config: Any | None) -> Any | None:
    """The spec the engine's `KVCacheLayout` is read from (its first attention group's; None
    before vLLM made one); `ValueError` at start-up, naming the group, for what kvtransfer does
    not move (see `vllm_kv_groups`)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return None
    vllm_kv_groups(kv_cache_config)
    attention = [g for g in groups if type(g.kv_cache_spec).__name__ != "MambaSpec"]
    if not attention:
        raise ValueError(
            "the model has no attention layer (recurrent state only): kvtransfer connectors "
            "in vLLM move state beside attention KV, not a pure state-space model's"
        )
    spec = attention[0].kv_cache_spec
    if type(spec).__name__ == _UNIFORM:
        # Sparse MLA (checked by `vllm_kv_groups`): the engine's width is the latents'; the
        # indexer caches get their own (`_mla_layer_widths`).
        return next(s for s in spec.kv_cache_specs.values() if _role(s) != _INDEXER_ROLE)
    return spec


def vllm_kv_groups(
    kv_cache_config: Any | None, block_size: int | None = None, vllm_config: Any | None = None
) -> tuple[KVCacheGroup, ...]:
    """vLLM's KV cache groups as ours, in vLLM's order (the order of a request's block lists);
    ``()`` for one full-attention group (the layout's default). `ValueError` at start-up naming
    the group vLLM built that kvtransfer does not move: recurrent state, sliding-window MLA,
    sparse MLA latents without their indexer caches, padded pages, layers of unequal page sizes
    (``UniformTypeKVCacheSpecs``) other than sparse MLA's, a group of another block size."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    has_indexer = any(
        _role(each) == _INDEXER_ROLE for group in groups for each in _specs_in(group.kv_cache_spec)
    )
    ours = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if is_whole_page_group(spec):
            ours.append(_whole_page_group(index, len(groups), group, spec, block_size))
            continue
        if kind == _UNIFORM:
            # Layers of one kind with unequal page sizes: moved only as sparse MLA's latents
            # and indexer caches, each layer whole on its own width (`_mla_layer_widths`).
            for name, each in _uniform_mla_specs(index, len(groups), spec).items():
                _check_mla(each, name, has_indexer)
            kind = "MLAAttentionSpec"
        else:
            _check_mla(spec, None, has_indexer)
        if kind not in _GROUP_KINDS:
            what = _NOT_MOVED.get(kind, "a kind of KV cache kvtransfer does not know")
            layers = list(getattr(group, "layer_names", ()))[:3]
            raise ValueError(
                f"KV cache group {index} of {len(groups)} is {kind} ({what}, layers {layers}): "
                "kvtransfer connectors in vLLM move full-attention, MLA and sliding-window KV; "
                "this model's cannot be transferred"
            )
        if kind == "MambaSpec":
            ours.append(_state_group(index, group, spec, vllm_config))
            continue
        spec_block = getattr(spec, "block_size", None)
        if block_size is not None and spec_block is not None and int(spec_block) != block_size:
            raise ValueError(
                f"KV cache group {index} ({kind}) has {spec_block}-token blocks, the engine "
                f"{block_size}: kvtransfer connectors need one block size for every group"
            )
        window = _window(spec) if kind == "SlidingWindowSpec" else None
        ours.append(
            KVCacheGroup(
                _GROUP_KINDS[kind],
                tuple(getattr(group, "layer_names", ()) or ()),
                None if window is None else int(window),
            )
        )
    if len(ours) <= 1 and all(g.kind == FULL_ATTENTION for g in ours):
        return ()
    return tuple(ours)


def _window(spec: Any) -> int:
    """The tokens a sliding-window spec keeps readable behind a request's next position: its
    window, plus the trailing tokens vLLM 0.33 retains for multi-module speculative decoding."""
    return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)


# DeepSeek-V4's MLA caches: latents compressed several tokens to a state
# (``tokens_per_state``), sliding-window latents and compressor states, pages padded to an
# alignment, each group of its own block size. vLLM packs them block-outermost.
_V4_MARKS = ("model_version", "page_size_padded", "alignment")


def is_whole_page_group(spec: Any) -> bool:
    """Whether a vLLM group's layers are DeepSeek-V4's MLA pages, moved as whole pages:
    sliding-window MLA, compressed latents (``tokens_per_state`` > 1), padded or aligned ones
    (`_V4_MARKS`), and the groups vLLM packs them with."""
    for each in _specs_in(spec):
        kind = type(each).__name__
        if kind == "SlidingWindowMLASpec":
            return True
        if kind == "MLAAttentionSpec" and (
            getattr(each, "tokens_per_state", 1) not in (None, 1)
            or any(getattr(each, mark, None) is not None for mark in _V4_MARKS)
        ):
            return True
    return False


def _whole_page_group(
    index: int, num_groups: int, group: Any, spec: Any, block_size: int | None
) -> KVCacheGroup:
    """A group of DeepSeek-V4's MLA pages (`is_whole_page_group`) as ours: full attention or
    a sliding window by its specs' kind, at its own block size, each layer's page moved whole
    from any producer rank (one latent per state: every TP rank holds the same). `ValueError`
    naming the group for what such pages cannot carry: heads split across TP, specs of both
    kinds or several windows in one group, bounded replay."""
    specs = _layer_specs(group)
    kinds = sorted({type(each).__name__ for each in specs.values()})
    windows = {
        _window(each)
        for each in specs.values()
        if getattr(each, "sliding_window", None) is not None
    }
    blocks = {int(each.block_size) for each in specs.values()}
    layers = list(specs)[:3]
    problem = ""
    if any(int(getattr(each, "num_kv_heads", 1)) != 1 for each in specs.values()):
        problem = "several heads per page, which TP would split"
    elif kinds not in (["MLAAttentionSpec"], ["SlidingWindowMLASpec"]):
        problem = f"layers of kinds {kinds}"
    elif len(windows) > 1 or len(blocks) != 1:
        problem = f"windows {sorted(windows)} and block sizes {sorted(blocks)}"
    elif any(getattr(each, "bounded_replay", False) for each in specs.values()):
        problem = "bounded replay (DeepSeek-V4.1's window, which a decode re-reads further)"
    if problem:
        raise ValueError(
            f"KV cache group {index} of {num_groups} holds DeepSeek-V4 MLA pages with "
            f"{problem} (layers {layers}): kvtransfer connectors in vLLM move such a group as "
            "whole pages of one kind, window and block size, the same on every TP rank"
        )
    (own_block,) = blocks
    window = windows.pop() if windows else None
    return KVCacheGroup(
        SLIDING_WINDOW if window is not None else FULL_ATTENTION,
        tuple(specs),
        window,
        block_size=None if own_block == block_size else own_block,
        whole_pages=True,
    )


def _state_group(index: int, group: Any, spec: Any, vllm_config: Any | None) -> KVCacheGroup:
    """A ``MambaSpec`` group: one running-state block per request, its page moved in parts
    split by heads (Mamba2, Gated DeltaNet: `vllm_state_parts`) or whole."""
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "none":
        raise ValueError(
            f"KV cache group {index} (MambaSpec) keeps states at block boundaries "
            f"(mamba_cache_mode {mode!r}, prefix caching of recurrent state): kvtransfer "
            "connectors move one running state per request; run with --no-enable-prefix-caching"
        )
    return KVCacheGroup(
        RECURRENT_STATE,
        tuple(getattr(group, "layer_names", ()) or ()),
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        state_parts=vllm_state_parts(spec, vllm_config),
    )


def _role(spec: Any) -> str:
    """An MLA spec's ``cache_role`` ("sparse": a latent, vLLM's default; "indexer")."""
    role = getattr(spec, "cache_role", None)
    return str(getattr(role, "value", role) or "sparse")


def _check_mla(spec: Any, layer: str | None, has_indexer: bool) -> None:
    """`ValueError` naming the spec (and ``layer``) for an MLA cache kvtransfer does not move
    per token (DeepSeek-V4's pages are taken before: `is_whole_page_group`): another MLA kind,
    several head slots, a sparse latent without its indexer's k-cache in the engine's groups
    (``has_indexer``)."""
    kind = type(spec).__name__
    if "MLA" not in kind or kind == "SlidingWindowMLASpec":
        return  # not MLA, or refused by kind (`_NOT_MOVED`)
    extras = [
        name
        for name in _MLA_EXTRAS
        if getattr(spec, name, None) is not None and not (has_indexer and name in _SPARSE_MARKS)
    ]
    extras += [
        name
        for name in ("tokens_per_state", "num_head_slots")
        if getattr(spec, name, None) not in (None, 1)
    ]
    if getattr(spec, "is_index_group_leader", False) is True and not has_indexer:
        extras.append("is_index_group_leader")
    if kind != "MLAAttentionSpec" or extras:
        where = "" if layer is None else f" (layer {layer!r})"
        raise ValueError(
            f"the model's KV cache is {kind}{where} ({', '.join(extras) or 'not a plain latent'}"
            "): kvtransfer connectors in vLLM move plain MLA caches (one latent per token, "
            "DeepSeek V2/V3), sparse MLA latents beside their indexer's k-cache (DeepSeek-"
            "V3.2, GLM-5) and DeepSeek-V4's pages, not sparse latents without their indexer "
            "cache"
        )


def _uniform_mla_specs(index: int, num_groups: int, spec: Any) -> dict[str, Any]:
    """A ``UniformTypeKVCacheSpecs`` group's per-layer specs when they are all plain
    ``MLAAttentionSpec`` of its block size, at least one a latent (sparse MLA); `ValueError`
    naming the group and its layers' kinds otherwise."""
    specs = dict(getattr(spec, "kv_cache_specs", None) or {})
    kinds = sorted({type(each).__name__ for each in specs.values()})
    blocks = {getattr(each, "block_size", None) for each in specs.values()}
    latents = [name for name, each in specs.items() if _role(each) != _INDEXER_ROLE]
    if kinds != ["MLAAttentionSpec"] or len(blocks) != 1 or not latents:
        raise ValueError(
            f"KV cache group {index} of {num_groups} is {_UNIFORM} (layers of one kind with "
            f"unequal page sizes: {', '.join(kinds) or 'none'}, block sizes "
            f"{sorted(blocks, key=str)}, layers {list(specs)[:3]}): kvtransfer connectors in "
            "vLLM move such a group only as sparse MLA (MLAAttentionSpec latents and their "
            "indexer's k-cache, one block size); this model's cannot be transferred"
        )
    return specs


def kv_split_for(device: torch.device, configured: str | None = None) -> str:
    """The K/V convention of vLLM's backend on ``device`` (``configured`` overrides)."""
    if configured is not None:
        if configured not in KV_SPLITS:
            raise ValueError(
                f"kv_connector_extra_config.vllm_kv_split must be one of {list(KV_SPLITS)}, "
                f"got {configured!r}"
            )
        return configured
    return "rows" if device.type == "cpu" else "last_axis"


def vllm_kv_views(
    kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout, split: str | None = None
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer 4-D ``[blocks, heads, block_size, C]`` views (any strides: vLLM builds
    them with ``as_strided`` over one buffer in any `KVCacheLayout`, block-outermost included)
    as ``[blocks, 2, heads, block_size, head_dim]`` views of the same memory, no copy, with K
    and V where the backend reads them (``split``: see `KV_SPLITS`; by device if None).

    `ValueError` naming the layer for what cannot be viewed so: another rank of tensor, a block
    size or head size the layout does not expect, a split that the strides do not allow."""
    views = {}
    state_layers = {n for g in layout.groups if g.is_state for n in g.layer_names}
    whole_pages = {n for g in layout.groups if g.whole_pages for n in g.layer_names}
    for name, cache in kv_caches.items():
        if name in state_layers:
            views[name] = state_page_view(name, cache)
            continue
        if name in whole_pages:
            views[name] = whole_page_view(name, cache)
            continue
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(
                f"KV cache {name!r} is not a 4-D [blocks, heads, block_size, C] tensor "
                f"(got {getattr(cache, 'shape', type(cache).__name__)}; MLA caches are "
                "[blocks, 1, block_size, latent])"
            )
        views[name] = _b2hnd(name, cache, layout, kv_split_for(cache.device, split))
    return views


def state_page_view(name: str, cache: Any) -> torch.Tensor:
    """A recurrent-state layer's cache (vLLM hands its pages as ``[blocks, 1, 1, bytes]`` of
    int8: conv and SSM state back to back, pages padded to the attention page) as a
    ``[blocks, 2, 1, 1, bytes / 2]`` uint8 view of the same memory: each block's state moves
    as one opaque page, in two halves where attention moves K and V."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[1:3] != (1, 1):
        raise ValueError(
            f"recurrent-state cache {name!r} is not one [blocks, 1, 1, bytes] page tensor "
            f"(got {getattr(cache, 'shape', type(cache).__name__)}): kvtransfer moves vLLM's "
            "state pages, not separate conv and SSM tensors"
        )
    blocks, _, _, width = cache.shape
    if cache.element_size() != 1 or cache.stride(-1) != 1 or width % 2:
        raise ValueError(
            f"recurrent-state cache {name!r} ({cache.dtype}, shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}) is not an even number of dense bytes per block"
        )
    half = width // 2
    pages = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return pages.as_strided(
        (blocks, 2, 1, 1, half), (cache.stride(0), half, half, half, 1), pages.storage_offset()
    )


def whole_page_view(name: str, cache: Any) -> torch.Tensor:
    """A DeepSeek-V4 MLA layer's cache (vLLM's ``[blocks, 1, states, C]``: compressed or
    sliding-window latents, compressor states; each block's page dense, blocks strided by the
    packed block) as a ``[blocks, 2, 1, 1, bytes / 2]`` uint8 view of the same memory: its
    page's bytes, without the padding after them."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError(
            f"KV cache {name!r} is not a 4-D [blocks, heads, states, C] tensor (got "
            f"{getattr(cache, 'shape', type(cache).__name__)})"
        )
    blocks = cache.shape[0]
    page = cache[0]
    size = page.numel() * cache.element_size()
    block_stride = cache.stride(0) * cache.element_size()
    if not page.is_contiguous() or size % 2 or block_stride < size:
        raise ValueError(
            f"KV cache {name!r} ({cache.dtype}, shape {tuple(cache.shape)}, strides "
            f"{cache.stride()}) does not hold each block's page as an even number of dense bytes"
        )
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), 0, (cache.untyped_storage().nbytes(),), (1,)
    )
    half = size // 2
    start = cache.storage_offset() * cache.element_size()
    return raw.as_strided((blocks, 2, 1, 1, half), (block_stride, half, half, half, 1), start)


def _b2hnd(name: str, cache: torch.Tensor, layout: KVCacheLayout, split: str) -> torch.Tensor:
    blocks, heads, tokens, width = cache.shape
    s_block, s_head, s_token, s_elem = cache.stride()
    head_dim, _ = layout.width_of(name)  # an indexer k-cache has its own
    if layout.block_size % tokens:
        # A smaller one is a kernel block (vLLM splits a block for some backends, e.g.
        # FlashInfer's 64-token pages under --block-size 128): moved as such.
        raise ValueError(
            f"KV cache {name!r} has block size {tokens}; the engine's layout says "
            f"{layout.block_size}, which is not a whole number of {tokens}-token kernel blocks"
        )
    if split == "heads":
        if heads % 2 or width != head_dim:
            raise ValueError(
                f"KV cache {name!r} of shape {tuple(cache.shape)} cannot hold K's heads then "
                f"V's with head_dim {head_dim}"
            )
        shape = (blocks, 2, heads // 2, tokens, width)
        strides = (s_block, (heads // 2) * s_head, s_head, s_token, s_elem)
    else:
        if width != 2 * head_dim:
            raise ValueError(
                f"KV cache {name!r} has a last axis of {width}; K and V of head_dim "
                f"{head_dim} need {2 * head_dim}"
            )
        if split == "last_axis":
            shape = (blocks, 2, heads, tokens, head_dim)
            strides = (s_block, head_dim * s_elem, s_head, s_token, s_elem)
        else:
            # K's block_size rows then V's: needs a head's [tokens, C] dense, as vLLM's view().
            if s_elem != 1 or s_token != width:
                raise ValueError(
                    f"KV cache {name!r} (strides {cache.stride()}) does not hold each head's "
                    "tokens densely, which vLLM's CPU attention reads them as"
                )
            shape = (blocks, 2, heads, tokens, head_dim)
            strides = (s_block, tokens * head_dim, s_head, head_dim, 1)
    return cache.as_strided(shape, strides, cache.storage_offset())


def group_block_ids(blocks: Any, num_groups: int) -> list[int] | tuple[list[int], ...]:
    """The block ids of vLLM's ``KVCacheBlocks``: the one group's list for a model with one KV
    cache group, else one list per group (`ValueError` when they do not match the groups)."""
    groups = blocks.get_block_ids()
    if len(groups) != num_groups:
        raise ValueError(
            f"the request has {len(groups)} KV cache groups; the engine's layout has {num_groups}"
        )
    if num_groups == 1:
        return list(groups[0])
    return tuple(list(group) for group in groups)


# Set in a request's kv_transfer_params once its last prompt token was left to the decode.
BACKED_OFF = "_kvtransfer_left_last_token"


def leave_last_prompt_token(request: Any) -> None:
    """Drop the last prompt token of vLLM's ``request`` (a prefill for a remote decode of a
    model with recurrent state) and stop it after one token; once per request (a preempted
    request is seen again), never for a one-token prompt or one that skips the prefix cache
    (prompt logprobs: the decode then recomputes the whole prompt)."""
    params = request.kv_transfer_params
    skips = getattr(request, "get_skip_reading_prefix_cache", None)
    if (
        params.get(BACKED_OFF)
        or request.num_prompt_tokens <= 1
        or request.prompt_token_ids is None
        or (callable(skips) and skips())
    ):
        return
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params[BACKED_OFF] = True


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
