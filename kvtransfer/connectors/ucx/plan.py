"""Which remote workers a local worker pulls from, and which layers and heads from each.

A remote engine's handshake metadata is registered in `TransferTopology` (one per model: the
target, and the drafter when there is one, whose layers live on the last PP stage of both
engines), per remote ``(engine_id, pp_rank)`` with the layer range it holds. The topology then
answers, for this worker's own layers, which remote PP ranks hold them (`layer_sources`) and
which remote TP ranks hold its KV heads, each replicated head read once (`head_sources`). Their
product is one `PlannedPull` per (remote worker, head slice): a plan depends only on the two
engines' layouts, so it is computed once per remote engine and reused for every request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtransfer.connector.kv_groups import KVCacheGroup, for_group
from kvtransfer.connector.metadata import PpTpRank
from kvtransfer.connector.state_parts import part_layer_name
from kvtransfer.connector.topology import (
    EngineTransferInfo,
    TransferTopology,
    head_sources_between,
    kv_head_range,
)
from kvtransfer.connectors.ucx.identity import WorkerIdentity
from kvtransfer.connectors.ucx.metadata import RemotePrefill, UcxHandshakeMetadata, UcxLayer


class RemoteLayoutError(ValueError):
    """The remote engine's workers do not hold what this worker needs, or contradict each
    other or the request's ``kv_transfer_params``."""


@dataclass(frozen=True)
class PlannedPull:
    remote_rank: PpTpRank
    layer_names: tuple[str, ...]
    remote_heads: range  # indexes the remote worker's head axis
    local_heads: range  # indexes this worker's head axis
    group: int = 0  # the local KV cache group of every layer in it


@dataclass
class LocalTopologies:
    """This worker's `TransferTopology` per model it holds layers of."""

    target: TransferTopology
    draft: TransferTopology | None

    @classmethod
    def of(cls, identity: WorkerIdentity) -> LocalTopologies:
        return cls(
            target=_topology(identity, identity.total_kv_heads, identity.target_layers()),
            draft=None
            if identity.draft_total_kv_heads is None
            else _topology(identity, identity.draft_total_kv_heads, identity.draft_layers()),
        )

    def unregister(self, engine_id: str) -> None:
        self.target.unregister_remote_engine(engine_id)
        if self.draft is not None:
            self.draft.unregister_remote_engine(engine_id)


def _topology(
    identity: WorkerIdentity, total_heads: int, layers: list[UcxLayer]
) -> TransferTopology:
    return TransferTopology(
        tp_rank=identity.tp_rank,
        tp_size=identity.tp_size,
        block_size=identity.block_size,
        engine_id=identity.engine_id,
        is_mla=False,
        total_num_kv_heads=total_heads,
        pp_rank=identity.pp_rank,
        pp_size=identity.pp_size,
        start_layer=layers[0].index if layers else 0,
        end_layer=layers[-1].index + 1 if layers else 0,
    )


def check_remote_engine(
    remote: RemotePrefill, metadata: Mapping[PpTpRank, UcxHandshakeMetadata]
) -> None:
    """Every worker of the remote TP x PP grid published, consistently with the params."""
    sizes = {(md.tp_size, md.pp_size) for md in metadata.values()}
    if len(sizes) != 1:
        raise RemoteLayoutError(
            f"workers of engine {remote.engine_id!r} disagree on TP x PP: {sorted(sizes)}"
        )
    ((tp_size, pp_size),) = sizes
    if (tp_size, pp_size) != (remote.tp_size, remote.pp_size):
        raise RemoteLayoutError(
            f"engine {remote.engine_id!r} runs TP {tp_size} x PP {pp_size} but the request's "
            f"kv_transfer_params say TP {remote.tp_size} x PP {remote.pp_size}"
        )
    grid = {(p, t) for p in range(pp_size) for t in range(tp_size)}
    if set(metadata) != grid:
        raise RemoteLayoutError(
            f"engine {remote.engine_id!r} published workers {sorted(metadata)}, expected "
            f"{sorted(grid)}"
        )
    for rank, md in metadata.items():
        if (md.pp_rank, md.tp_rank) != rank or md.engine_id != remote.engine_id:
            raise RemoteLayoutError(
                f"the payload served for {rank} of engine {remote.engine_id!r} describes "
                f"worker ({md.pp_rank}, {md.tp_rank}) of engine {md.engine_id!r}"
            )


def check_request_blocks(
    remote: RemotePrefill, block_size: int, groups: Sequence[KVCacheGroup]
) -> None:
    """A producer lists, per KV cache group, exactly the blocks of ``remote_num_tokens`` at its
    block size (a sliding-window group: at most the tail its window reaches): any other list
    was not returned by it, and must not pick (or skip) blocks silently."""
    if len(remote.block_ids) != len(groups):
        raise RemoteLayoutError(
            f"kv_transfer_params.remote_block_ids holds {len(remote.block_ids)} block list(s); "
            f"this engine has {len(groups)} KV cache group(s) "
            f"({', '.join(g.describe() for g in groups)})"
        )
    for group, blocks in zip(groups, remote.block_ids, strict=True):
        if group.is_state:
            if len(blocks) != 1:
                raise RemoteLayoutError(
                    f"kv_transfer_params.remote_block_ids holds {len(blocks)} blocks for "
                    f"{group.describe()}: a producer lends one state block per request"
                )
            continue
        needed = group.blocks_for(remote.num_tokens, block_size)
        size = group.tokens_per_block(block_size)
        kept = group.blocks_kept(block_size)
        if kept is None and len(blocks) != needed:
            raise RemoteLayoutError(
                f"kv_transfer_params.remote_block_ids holds {len(blocks)} blocks"
                f"{for_group(group, len(groups))}, remote_num_tokens {remote.num_tokens} needs "
                f"exactly {needed} of engine {remote.engine_id!r}'s {size}-token blocks"
            )
        if kept is not None and not (min(1, needed) <= len(blocks) <= min(kept, needed)):
            raise RemoteLayoutError(
                f"kv_transfer_params.remote_block_ids holds {len(blocks)} blocks for "
                f"{group.describe()}; its window reaches at most {min(kept, needed)} of "
                f"engine {remote.engine_id!r}'s {size}-token blocks (at least one)"
            )


def plan_pulls(
    identity: WorkerIdentity,
    topologies: LocalTopologies,
    engine_id: str,
    metadata: Mapping[PpTpRank, UcxHandshakeMetadata],
) -> list[PlannedPull]:
    """Register ``engine_id``'s workers and plan this worker's pulls from them.

    Raises `RemoteLayoutError` (or the topology's `ValueError`s) when the remote engine cannot
    provide every layer and head this worker holds.
    """
    split = {md.kernel_blocks for md in metadata.values()}
    if split != {identity.kernel_blocks}:
        # Kernel blocks are what both sides registered and read: their sizes must agree.
        raise RemoteLayoutError(
            f"engine {engine_id!r} stores its {identity.block_size}-token blocks as "
            f"{sorted(split)} kernel block(s) each, this worker as {identity.kernel_blocks} "
            "(different attention backends): kernel block sizes must match"
        )
    merged: dict[tuple[PpTpRank, range, range, int], list[str]] = {}
    models = [(False, topologies.target, identity.target_layers())]
    if topologies.draft is not None:
        models.append((True, topologies.draft, identity.draft_layers()))
    for is_draft, topology, layers in models:
        if not layers:
            continue
        _register(topology, engine_id, metadata, is_draft)
        # A model layer may hold several caches (an MLA latent and its indexer's k-cache).
        by_index: dict[int, list[UcxLayer]] = {}
        for layer in layers:
            by_index.setdefault(layer.index, []).append(layer)
        for source in topology.layer_sources(engine_id):
            at = [layer for i in source.layers for layer in by_index[i]]
            states = [layer for layer in at if layer.state_width is not None]
            held = [layer for layer in at if layer.state_width is None]
            for layer in states:
                group = identity.group_of(layer.name)
                for rank, remote_heads, local_heads, name in _state_pulls(
                    identity, engine_id, metadata, source.remote_pp_rank, layer
                ):
                    key = (rank, remote_heads, local_heads, group)
                    merged.setdefault(key, []).append(name)
            if not held:
                continue
            for head in topology.head_sources(engine_id, source.remote_pp_rank):
                rank = (source.remote_pp_rank, head.remote_tp_rank)
                _check_serves(engine_id, metadata[rank], held)
                for layer in held:
                    key = (
                        rank,
                        range(head.remote_offset, head.remote_offset + head.num_heads),
                        range(head.local_offset, head.local_offset + head.num_heads),
                        identity.group_of(layer.name),
                    )
                    merged.setdefault(key, []).append(layer.name)
    return [
        PlannedPull(rank, tuple(names), remote_heads, local_heads, group)
        for (rank, remote_heads, local_heads, group), names in sorted(
            merged.items(), key=lambda item: (item[0][0], item[0][2].start, item[0][3])
        )
    ]


def _register(
    topology: TransferTopology,
    engine_id: str,
    metadata: Mapping[PpTpRank, UcxHandshakeMetadata],
    is_draft: bool,
) -> None:
    kind = "drafter" if is_draft else "target"
    registered = 0
    for (pp, tp), md in sorted(metadata.items()):
        layers = md.draft_layers() if is_draft else md.target_layers()
        if not layers:
            continue
        total = md.draft_total_kv_heads if is_draft else md.total_kv_heads
        held = md.draft_kv_heads if is_draft else md.kv_heads
        if total != topology.total_num_kv_heads:
            raise RemoteLayoutError(
                f"engine {engine_id!r} has {total} {kind} KV heads, this engine "
                f"{topology.total_num_kv_heads}"
            )
        expected = kv_head_range(tp, md.tp_size, topology.total_num_kv_heads)
        if held is None or range(*held) != expected:
            raise RemoteLayoutError(
                f"worker ({pp}, {tp}) of engine {engine_id!r} holds {kind} KV heads {held}, "
                f"expected [{expected.start},{expected.stop})"
            )
        if tp != 0:
            continue  # one registration per PP rank; its TP ranks hold the same layers
        indices = sorted({layer.index for layer in layers})
        if indices != list(range(indices[0], indices[-1] + 1)):
            raise RemoteLayoutError(
                f"worker ({pp}, {tp}) of engine {engine_id!r} holds non-contiguous {kind} "
                f"layers {indices}"
            )
        element_size = getattr(torch, md.dtype).itemsize
        heads = next((la.num_kv_heads for la in layers if la.state_width is None), 1)
        topology.register_remote_engine(
            engine_id,
            EngineTransferInfo(
                remote_tp_size=md.tp_size,
                remote_block_len=2
                * heads
                * (md.block_size // md.kernel_blocks)
                * md.head_dim
                * element_size,
                remote_block_size=md.block_size,
                remote_physical_blocks_per_logical=md.kernel_blocks,
                remote_pp_rank=pp,
                start_layer=indices[0],
                end_layer=indices[-1] + 1,
            ),
        )
        registered += 1
    if not registered:
        raise RemoteLayoutError(f"engine {engine_id!r} holds no {kind} layers; this worker does")


def _state_pulls(
    identity: WorkerIdentity,
    engine_id: str,
    metadata: Mapping[PpTpRank, UcxHandshakeMetadata],
    remote_pp_rank: int,
    layer: UcxLayer,
) -> list[tuple[PpTpRank, range, range, str]]:
    """Where this worker's recurrent-state page of ``layer`` comes from: ``(remote worker,
    its heads, our heads, transport layer)``. An opaque page is the same TP rank's, whole; a
    page laid out per head is read head range by head range from every remote TP rank holding
    some of ours; a page in parts, each part's heads from the ranks holding them."""
    remote_tp = next(iter(metadata.values())).tp_size
    if layer.state_parts:
        return _part_pulls(identity, engine_id, metadata, remote_pp_rank, layer)
    if layer.replicated:
        # Every producer rank holds the same page: spread the consumer's ranks over them.
        rank = (remote_pp_rank, identity.tp_rank % remote_tp)
        _check_serves(engine_id, metadata[rank], [layer])
        return [(rank, range(0, 1), range(0, 1), layer.name)]
    if not layer.state_split:
        if remote_tp != identity.tp_size:
            raise RemoteLayoutError(
                f"engine {engine_id!r} runs TP {remote_tp} and this engine TP "
                f"{identity.tp_size}: recurrent state (Mamba / Gated DeltaNet) in opaque pages "
                "(vLLM's) is moved between equal TP sizes only (splitting it by sub-projection "
                "is not implemented)"
            )
        rank = (remote_pp_rank, identity.tp_rank)
        _check_serves(engine_id, metadata[rank], [layer])
        return [(rank, range(0, 1), range(0, 1), layer.name)]
    local = layer.num_kv_heads
    mine = range(identity.tp_rank * local, (identity.tp_rank + 1) * local)
    pulls = []
    for remote_tp_rank in range(remote_tp):
        rank = (remote_pp_rank, remote_tp_rank)
        _check_serves(engine_id, metadata[rank], [layer])
        theirs = next(la for la in metadata[rank].layers if la.name == layer.name)
        if theirs.num_kv_heads * remote_tp != local * identity.tp_size:
            raise RemoteLayoutError(
                f"layer {layer.name!r} has {theirs.num_kv_heads * remote_tp} state heads on "
                f"engine {engine_id!r} and {local * identity.tp_size} on this engine"
            )
        held = range(
            remote_tp_rank * theirs.num_kv_heads, (remote_tp_rank + 1) * theirs.num_kv_heads
        )
        lo, hi = max(mine.start, held.start), min(mine.stop, held.stop)
        if lo < hi:
            pulls.append(
                (
                    rank,
                    range(lo - held.start, hi - held.start),
                    range(lo - mine.start, hi - mine.start),
                    layer.name,
                )
            )
    return pulls


def _part_pulls(
    identity: WorkerIdentity,
    engine_id: str,
    metadata: Mapping[PpTpRank, UcxHandshakeMetadata],
    remote_pp_rank: int,
    layer: UcxLayer,
) -> list[tuple[PpTpRank, range, range, str]]:
    remote_tp = next(iter(metadata.values())).tp_size
    pulls = []
    for part in layer.state_parts:
        try:
            sources = head_sources_between(
                identity.tp_rank, identity.tp_size, remote_tp, part.total_heads
            )
        except ValueError as exc:
            raise RemoteLayoutError(
                f"state part {part.name!r} of layer {layer.name!r} has {part.total_heads} heads, "
                f"which engine {engine_id!r} (TP {remote_tp}) and this engine (TP "
                f"{identity.tp_size}) cannot both split: {exc}"
            ) from exc
        for source in sources:
            rank = (remote_pp_rank, source.remote_tp_rank)
            _check_serves(engine_id, metadata[rank], [layer])
            pulls.append(
                (
                    rank,
                    range(source.remote_offset, source.remote_offset + source.num_heads),
                    range(source.local_offset, source.local_offset + source.num_heads),
                    part_layer_name(layer.name, part.name),
                )
            )
    return pulls


def _check_serves(engine_id: str, md: UcxHandshakeMetadata, wanted: list[UcxLayer]) -> None:
    held = {layer.name: layer for layer in md.layers}
    missing = [layer.name for layer in wanted if layer.name not in held]
    if missing:
        raise RemoteLayoutError(
            f"worker ({md.pp_rank}, {md.tp_rank}) of engine {engine_id!r} does not hold layers "
            f"{missing}"
        )
    for layer in wanted:
        theirs = held[layer.name].kv_group
        if held[layer.name].replicated != layer.replicated:
            raise RemoteLayoutError(
                f"layer {layer.name!r} is {_replica(held[layer.name].replicated)} on engine "
                f"{engine_id!r} and {_replica(layer.replicated)} on this engine"
            )
        if held[layer.name].state_split != layer.state_split:
            raise RemoteLayoutError(
                f"layer {layer.name!r} keeps its state in "
                f"{_page_kind(held[layer.name].state_split)} on engine {engine_id!r} and in "
                f"{_page_kind(layer.state_split)} on this engine"
            )
        theirs_parts = [p.signature() for p in held[layer.name].state_parts]
        if theirs_parts != [p.signature() for p in layer.state_parts]:
            raise RemoteLayoutError(
                f"layer {layer.name!r} keeps its state in parts {_parts(theirs_parts)} on "
                f"engine {engine_id!r} and {_parts([p.signature() for p in layer.state_parts])} "
                "on this engine (name, heads, bytes per head, rows): their state layouts "
                "differ (model, dtype or vLLM's conv state layout)"
            )
        if layer.state_parts:
            continue  # parts are compared; page sizes differ with the TP size
        if held[layer.name].state_width != layer.state_width:
            raise RemoteLayoutError(
                f"layer {layer.name!r} holds {held[layer.name].state_width} x 2 state bytes per "
                f"block on engine {engine_id!r} and {layer.state_width} x 2 on this engine"
            )
        if theirs != layer.kv_group:
            # Another kind (or window) of cache: its blocks mean other tokens, or other state.
            raise RemoteLayoutError(
                f"layer {layer.name!r} is {theirs} on engine {engine_id!r} (worker "
                f"({md.pp_rank}, {md.tp_rank})) and {layer.kv_group} on this engine: the two "
                "engines' KV cache groups differ"
            )
        # A layer of its own width (an indexer k-cache beside MLA latents): both engines' own
        # head_dim and dtype matched at handshake (`compat`), so the remote's stand for ours.
        theirs_width, ours_width = md.width_of(held[layer.name]), md.width_of(layer)
        if layer.state_width is None and theirs_width != ours_width:
            raise RemoteLayoutError(
                f"layer {layer.name!r} holds {_width(theirs_width)} on engine {engine_id!r} and "
                f"{_width(ours_width)} on this engine: the two engines' layer widths differ"
            )


def _width(width: tuple[int, str]) -> str:
    head_dim, dtype = width
    return f"2 x {head_dim} {dtype} per token and head"


def _parts(signatures: Sequence[tuple[str, int, int, int]]) -> str:
    return (
        "[" + ", ".join(f"{n}: {h} x {b} B x {r}" for n, h, b, r in signatures) + "]"
        if signatures
        else "none (an opaque page)"
    )


def _replica(replicated: bool) -> str:
    return "whole pages, the same on every TP rank" if replicated else "split across TP ranks"


def _page_kind(split: bool) -> str:
    return "per-head pages" if split else "opaque pages"
