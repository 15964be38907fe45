"""Who a worker is, as far as KV transfer goes: its rank, layers, KV heads and cache shape.

Built once from the engine's `KVCacheLayout` and the registered caches. Layer names carry their
model position: ``model.layers.<i>.self_attn`` (target layer ``i``) and
``draft.layers.<j>.self_attn`` (drafter layer ``j``, on the last PP stage only). Also builds the
`CompatibilityInfo` both engines compare at handshake time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvtransfer.connector.kv_groups import FULL_ATTENTION, KVCacheGroup, check_groups
from kvtransfer.connector.metadata import KVCacheLayout
from kvtransfer.connector.state_parts import (
    PART_SEPARATOR,
    StatePart,
    check_parts,
    expand_state_parts,
)
from kvtransfer.connector.topology import kv_head_range
from kvtransfer.connectors.ucx.metadata import UcxHandshakeMetadata, UcxLayer
from kvtransfer.control import CompatibilityInfo

WIRE_VERSION = 1
# The order of the payloads on the wire ([blocks, 2, heads, block_size, head_dim]: heads outside
# tokens), which peers must agree on. How each stores its cache (`KVCacheLayout.kv_order`) need
# not match: gather and scatter convert (`kvtransfer.transport.spec`).
KV_LAYOUT = "HND"
UNSPECIFIED_MODEL = "unspecified"

_LAYER_NAME = re.compile(r"^(model|draft)\.layers\.(\d+)\.")


def parse_layer_name(name: str) -> tuple[bool, int]:
    """``(is_draft, index)`` of a KV layer name; `ValueError` for a name without a position."""
    match = _LAYER_NAME.match(name)
    if match is None:
        raise ValueError(
            f"KV layer {name!r} does not name its position; expected "
            "'model.layers.<i>.<...>' or 'draft.layers.<j>.<...>'"
        )
    return match.group(1) == "draft", int(match.group(2))


def compat_info(
    *,
    model: str,
    dtype: str,
    total_kv_heads: int,
    head_dim: int,
    num_layers: int,
    block_size: int,
) -> CompatibilityInfo:
    return CompatibilityInfo(
        model=model,
        dtype=dtype,
        total_num_kv_heads=total_kv_heads,
        head_size=head_dim,
        num_layers=num_layers,
        kv_layout=KV_LAYOUT,
        block_size=block_size,
        wire_version=WIRE_VERSION,
    )


def compat_dtype(dtype: str, cache_dtype: str) -> str:
    """The element type peers compare: the tensors' own, plus the cache format when it is not
    the model's (fp8 caches are uint8 tensors; two fp8 formats must refuse each other). The
    producer builds it from its layout and the consumer from its registered caches: both must
    come through here, or fp8 engines refuse each other."""
    return dtype if cache_dtype == "auto" else f"{dtype}:{cache_dtype}"


def compat_from_layout(layout: KVCacheLayout) -> CompatibilityInfo:
    return compat_info(
        model=layout.model,
        dtype=compat_dtype(layout.dtype, layout.cache_dtype),
        total_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
    )


@dataclass(frozen=True)
class WorkerIdentity:
    engine_id: str
    model: str
    pp_rank: int
    tp_rank: int
    pp_size: int
    tp_size: int
    layers: tuple[UcxLayer, ...]
    num_layers: int  # the whole target model's
    total_kv_heads: int
    draft_total_kv_heads: int | None
    block_size: int
    head_dim: int
    dtype: str
    num_blocks: int
    bytes_per_block: int  # this worker's share of one block, all its layers
    cache_dtype: str = "auto"  # the engine's cache format (`KVCacheLayout.cache_dtype`)
    # The caches hold each engine block as this many kernel blocks (vLLM's kernel split).
    kernel_blocks: int = 1
    # The engine's KV cache groups (`KVCacheLayout.groups`; one full-attention group when it
    # lists none) and each layer's index among them.
    groups: tuple[KVCacheGroup, ...] = ()
    layer_groups: Mapping[str, int] = field(default_factory=dict)

    def group_of(self, layer_name: str) -> int:
        return self.layer_groups.get(layer_name, 0)

    @property
    def kv_heads(self) -> range:
        return kv_head_range(self.tp_rank, self.tp_size, self.total_kv_heads)

    @property
    def draft_kv_heads(self) -> range | None:
        if self.draft_total_kv_heads is None:
            return None
        return kv_head_range(self.tp_rank, self.tp_size, self.draft_total_kv_heads)

    def target_layers(self) -> list[UcxLayer]:
        return sorted((la for la in self.layers if not la.is_draft), key=lambda la: la.index)

    def draft_layers(self) -> list[UcxLayer]:
        return sorted((la for la in self.layers if la.is_draft), key=lambda la: la.index)

    def compat(self) -> CompatibilityInfo:
        return compat_info(
            model=self.model,
            dtype=compat_dtype(self.dtype, self.cache_dtype),
            total_kv_heads=self.total_kv_heads,
            head_dim=self.head_dim,
            num_layers=self.num_layers,
            block_size=self.block_size,
        )

    def handshake(self, agent_address: str, data_plane: str = "tagged") -> UcxHandshakeMetadata:
        draft = self.draft_kv_heads
        return UcxHandshakeMetadata(
            engine_id=self.engine_id,
            pp_rank=self.pp_rank,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            tp_size=self.tp_size,
            agent_address=agent_address,
            layers=self.layers,
            kv_heads=(self.kv_heads.start, self.kv_heads.stop),
            total_kv_heads=self.total_kv_heads,
            draft_kv_heads=None if draft is None else (draft.start, draft.stop),
            draft_total_kv_heads=self.draft_total_kv_heads,
            block_size=self.block_size,
            head_dim=self.head_dim,
            dtype=self.dtype,
            num_blocks=self.num_blocks,
            data_plane=data_plane,
            kernel_blocks=self.kernel_blocks,
        )

    @classmethod
    def from_caches(
        cls,
        engine_id: str,
        layout: KVCacheLayout | None,
        caches: Mapping[str, torch.Tensor],
    ) -> WorkerIdentity:
        """Check the caches agree with each other and with ``layout`` (``None`` outside an
        engine: a single 1x1 worker holding every head of its layers)."""
        if not caches:
            raise ValueError("UcxConnector: register_kv_caches got no layers")
        groups = layout.groups if layout is not None and layout.groups else ()
        # Recurrent-state layers hold one page per block: opaque (`[blocks, 2, 1, 1, bytes/2]`
        # uint8) or per head (`[blocks, 2, heads, 1, unit]`, a group with `state_heads`),
        # checked for their own shape, not the attention layers'.
        # So are the layers of a group of whole pages (DeepSeek-V4's: opaque, one per block).
        state_groups = {
            n: g for g in groups if g.pages_opaque for n in g.layer_names if n in caches
        }
        state = set(state_groups)
        attention = {n: c for n, c in caches.items() if n not in state}
        if not attention and not any(g.whole_pages for g in groups):
            raise ValueError("UcxConnector: register_kv_caches got no attention layer")
        # Layers the layout gives their own width (an indexer k-cache beside MLA latents) are
        # checked against it; the others against the first of the engine's own width.
        widths = {w.name: (w.head_dim, w.dtype) for w in layout.layer_widths} if layout else {}
        engine_wide = [c for n, c in attention.items() if n not in widths]
        if attention and not engine_wide:
            raise ValueError(
                "every attention layer has a width of its own in the engine's layout; at "
                "least one must have the engine's head_dim and dtype"
            )
        # An engine of whole pages only has no per-token layer: its pages set the block count.
        first = engine_wide[0] if engine_wide else caches[next(iter(state_groups))]
        for name, group in state_groups.items():
            page = caches[name]
            heads = "heads" if group.state_heads is not None else "1"
            if group.state_parts and page.dim() == 5:
                check_parts(group.state_parts, 2 * int(page.shape[4]))
            if (
                page.dim() != 5
                or (page.shape[1], page.shape[3]) != (2, 1)
                or (group.state_heads is None and page.shape[2] != 1)
                or page.shape[0] != first.shape[0]
                or page.dtype != torch.uint8
            ):
                kind = "recurrent-state" if group.is_state else "whole-page"
                raise ValueError(
                    f"{kind} cache {name!r} has shape {tuple(page.shape)} "
                    f"({page.dtype}), expected [{first.shape[0]}, 2, {heads}, 1, page_bytes] "
                    "uint8"
                )
        for name, cache in attention.items():
            if cache.dim() != 5 or cache.shape[1] != 2:
                raise ValueError(
                    f"KV cache {name!r} has shape {tuple(cache.shape)}, expected "
                    "[num_blocks, 2, num_kv_heads, block_size, head_dim]"
                )
            if (cache.shape[0], cache.shape[3], cache.device) != (
                first.shape[0],
                first.shape[3],
                first.device,
            ):
                raise ValueError(
                    f"KV cache {name!r} differs from the others in num_blocks, block_size or device"
                )
            own = (int(cache.shape[4]), _dtype_name(cache.dtype))
            expected = widths.get(name, (int(first.shape[4]), _dtype_name(first.dtype)))
            if own != expected:
                said = "the engine's layout says" if name in widths else "the other layers have"
                raise ValueError(
                    f"KV cache {name!r} has head_dim {own[0]} of {own[1]}; {said} "
                    f"{expected[0]} of {expected[1]}"
                )
        if groups:
            check_groups(groups, list(caches))
        layer_groups = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        layers = []
        for name, cache in caches.items():
            is_draft, index = parse_layer_name(name)
            layers.append(
                UcxLayer(
                    name=name,
                    index=index,
                    is_draft=is_draft,
                    num_kv_heads=int(cache.shape[2]),
                    kv_group=groups[layer_groups[name]].label if groups else FULL_ATTENTION,
                    state_width=int(cache.shape[4]) if name in state else None,
                    state_split=name in state and state_groups[name].state_heads is not None,
                    state_parts=state_groups[name].state_parts if name in state else (),
                    replicated=name in state and state_groups[name].whole_pages,
                    head_dim=widths[name][0] if name in widths else None,
                    dtype=widths[name][1] if name in widths else None,
                )
            )
        target = [la for la in layers if not la.is_draft]
        draft = [la for la in layers if la.is_draft]
        if engine_wide:
            dtype = _dtype_name(first.dtype)
            block_size, head_dim = int(first.shape[3]), int(first.shape[4])
        elif layout is not None:
            dtype, block_size, head_dim = layout.dtype, layout.block_size, layout.head_dim
        if layout is None:
            layout = KVCacheLayout(
                model=UNSPECIFIED_MODEL,
                dtype=dtype,
                block_size=block_size,
                num_blocks=int(first.shape[0]),
                num_layers=len(target),
                num_kv_heads=target[0].num_kv_heads if target else layers[0].num_kv_heads,
                head_dim=head_dim,
                tp_rank=0,
                pp_rank=0,
            )
        if layout.rank is None:
            raise ValueError("UcxConnector worker got a KVCacheLayout without its (pp, tp) rank")
        pp_rank, tp_rank = layout.rank
        if (layout.head_dim, layout.dtype) != (head_dim, dtype) or layout.block_size % block_size:
            raise ValueError(
                f"KV caches are block_size {block_size}, head_dim {head_dim}, {dtype}; the "
                f"engine's layout says {layout.block_size}, {layout.head_dim}, {layout.dtype} "
                "(a cache block may be a kernel block: a divisor of the engine's block size)"
            )
        # vLLM may hand caches of kernel blocks: engine block b is kernel blocks b*k ... b*k+k-1.
        kernel_blocks = layout.block_size // block_size
        num_blocks = int(first.shape[0])
        if num_blocks % kernel_blocks:
            raise ValueError(
                f"KV caches hold {num_blocks} blocks of {block_size} tokens: not whole engine "
                f"blocks of {layout.block_size} ({kernel_blocks} kernel blocks each)"
            )
        if state and kernel_blocks > 1:
            raise ValueError(
                "recurrent-state layers beside attention split into kernel blocks: kvtransfer "
                "moves state pages of whole engine blocks only"
            )
        heads = kv_head_range(tp_rank, layout.tp_size, layout.num_kv_heads)
        wrong = [
            la.name for la in target if la.state_width is None and la.num_kv_heads != len(heads)
        ]
        if wrong:
            raise ValueError(
                f"target layers {wrong} do not hold {len(heads)} KV heads, the share of TP rank "
                f"{tp_rank} of {layout.tp_size} over {layout.num_kv_heads} heads"
            )
        for la in layers:
            for part in la.state_parts:
                share = kv_head_range(tp_rank, layout.tp_size, part.total_heads)
                if part.heads != len(share):
                    raise ValueError(
                        f"state part {part.name!r} of layer {la.name!r} holds {part.heads} of "
                        f"{part.total_heads} heads; TP rank {tp_rank} of {layout.tp_size} holds "
                        f"{len(share)}"
                    )
        # One model layer may hold several caches (an MLA latent and its indexer's k-cache).
        indices = sorted({la.index for la in target})
        if indices and indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"target layers {indices} are not a contiguous range")
        return cls(
            engine_id=engine_id,
            model=layout.model,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            pp_size=layout.pp_size,
            tp_size=layout.tp_size,
            layers=tuple(layers),
            num_layers=layout.num_layers,
            total_kv_heads=layout.num_kv_heads,
            draft_total_kv_heads=_draft_total_heads(draft, len(heads), layout),
            block_size=layout.block_size,
            head_dim=head_dim,
            dtype=dtype,
            num_blocks=num_blocks // kernel_blocks,
            bytes_per_block=kernel_blocks
            * sum(c[0].numel() * c.element_size() for c in caches.values()),
            cache_dtype=layout.cache_dtype,
            kernel_blocks=kernel_blocks,
            groups=groups or (KVCacheGroup(FULL_ATTENTION, tuple(caches)),),
            layer_groups={
                name: layer_groups.get(name.split(PART_SEPARATOR)[0], 0)
                for name in expand_state_parts(caches, _parts_of(layers))
            },
        )

    def transport_caches(self, caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the transport registers: ``caches`` with each state layer kept in parts
        replaced by its parts' views (`state_parts`)."""
        return expand_state_parts(caches, _parts_of(self.layers))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parts_of(layers: Sequence[UcxLayer]) -> dict[str, tuple[StatePart, ...]]:
    return {layer.name: layer.state_parts for layer in layers if layer.state_parts}


def _draft_total_heads(
    draft: list[UcxLayer], target_local_heads: int, layout: KVCacheLayout
) -> int | None:
    """The drafter's global KV head count, which the layout does not carry.

    A drafter split like the target (same local head count) has the target's total; otherwise
    its heads are taken as split without replication. A drafter that replicates heads under TP
    differently from the target cannot be told apart and is refused.
    """
    if not draft:
        return None
    local = {la.num_kv_heads for la in draft}
    if len(local) > 1:
        raise ValueError(f"drafter layers disagree on their KV head count: {sorted(local)}")
    (num_local,) = local
    if num_local == target_local_heads:
        return layout.num_kv_heads
    if num_local == 1 and layout.tp_size > 1:
        raise ValueError(
            "cannot tell how many KV heads the drafter has: it holds one per TP rank and the "
            "target does not"
        )
    return num_local * layout.tp_size
